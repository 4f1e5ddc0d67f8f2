"""Django's PostgreSQL backend, with a connection health check that costs no round trip, and
one plan for each of the hot paths' prepared statements (`_configure_connection`).

CONN_HEALTH_CHECKS sends a `SELECT 1` before the first statement of every request and task. A
connection PostgreSQL ended is readable (its FATAL message or close), so the check first asks
the socket without waiting; only a connection with something to read, or not idle, gets
Django's `SELECT 1`. A peer that vanished without a word passes, as it would pass nothing.
Why: docs/DESIGN.md."""

from __future__ import annotations

import select

from django.db.backends.postgresql import base
from psycopg import pq


class DatabaseWrapper(base.DatabaseWrapper):
    def _configure_connection(self, connection: object) -> bool:
        commit = super()._configure_connection(connection)
        if self.settings_dict["OPTIONS"].get("prepare_threshold") is None:
            return commit  # nothing is prepared (behind a transaction pooler): nothing to set
        # The hot paths' prepared statements (core/rows.py) are written for one plan of
        # any parameters (states in their text, ids as arrays): left to choose, PostgreSQL
        # kept planning the routing statement afresh on every run (docs/PERFORMANCE.md).
        with connection.cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute("SET plan_cache_mode = force_generic_plan")
        return True

    def close_if_health_check_failed(self) -> None:
        if (
            self.connection is not None
            and self.health_check_enabled
            and not self.health_check_done
            and not self.pool
            and quiet(self.connection)
        ):
            self.health_check_done = True
            return
        super().close_if_health_check_failed()


def quiet(connection: object) -> bool:
    """True when the connection is open, idle outside a transaction, and its socket has
    nothing to read: nothing says it is broken. False: ask the server."""
    try:
        pgconn = connection.pgconn  # type: ignore[attr-defined]
        if pgconn.status != pq.ConnStatus.OK or pgconn.transaction_status != pq.TransactionStatus.IDLE:
            return False
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN | select.POLLPRI)
        return not poller.poll(0)
    except Exception:  # noqa: BLE001 - any doubt: the usual check decides
        return False
