"""Django's PostgreSQL backend, with a connection health check that costs no round trip, a
cursor for the hot paths' fixed statements (`prepared_cursor`), and one plan for each of them
(`_configure_connection`).

CONN_HEALTH_CHECKS sends a `SELECT 1` before the first statement of every request and task. A
connection PostgreSQL ended is readable (its FATAL message or close), so the check first asks
the socket without waiting; only a connection with something to read, or not idle, gets
Django's `SELECT 1`. A peer that vanished without a word passes, as it would pass nothing.
Why: docs/DESIGN.md."""

from __future__ import annotations

import select
from datetime import UTC
from typing import Any

import psycopg
from django.db.backends.postgresql import base, operations
from django.db.backends.utils import CursorWrapper
from psycopg import postgres, pq

# psycopg's own timestamptz loader, in C when its binary build is installed: far cheaper than
# the loader Django registers on every connection (a subclass in Python of psycopg's Python
# loader, so that a time zone other than the connection's can be forced), and the hot paths
# read many timestamps. It gives the connection's time zone, which Django sets to UTC when
# its own is UTC (`db.timezone`): the same values as Django's.
_TIMESTAMPTZ_OID = postgres.types["timestamptz"].oid
_TIMESTAMPTZ_C = psycopg.adapters.get_loader(_TIMESTAMPTZ_OID, pq.Format.TEXT)
if _TIMESTAMPTZ_C is None or not _TIMESTAMPTZ_C.__module__.startswith("psycopg_"):
    _TIMESTAMPTZ_C = None  # psycopg's pure Python build: nothing faster to swap in


class PreparedCursor(base.ServerBindingCursor):
    """Django's cursor for OPTIONS["server_side_binding"] (parameters bound by the server),
    whose statements psycopg prepares on their first run in a connection: planning the hot
    paths' statements cost PostgreSQL more than running them. A no-op where the connection's
    prepare_threshold is None (behind a transaction pooler)."""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = True, binary: bool | None = None
    ) -> Any:
        return super().execute(query, params, prepare=prepare, binary=binary)


class DatabaseOperations(operations.DatabaseOperations):
    def last_executed_query(self, cursor: Any, sql: str, params: Any) -> str | None:
        # A prepared statement's run leaves psycopg no text to read back: DEBUG's query log
        # (and the tests' query counts) shows such a statement as it was given.
        return super().last_executed_query(cursor, sql, params) or sql


class DatabaseWrapper(base.DatabaseWrapper):
    ops_class = DatabaseOperations

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

    def prepared_cursor(self, *, fast_times: bool = False) -> CursorWrapper:
        """`cursor()` for a fixed statement: the same wrapper (the health check, error
        translation, the broken-transaction check, execute wrappers, DEBUG's query log), over a
        `PreparedCursor`. `fast_times`: timestamps read by psycopg's C loader (for rows to
        read; the loader is registered per cursor)."""
        self.close_if_health_check_failed()
        self.ensure_connection()
        with self.wrap_database_errors:
            cursor = PreparedCursor(self.connection)
            if fast_times and self.timezone is UTC and _TIMESTAMPTZ_C is not None:
                cursor.adapters.register_loader(_TIMESTAMPTZ_OID, _TIMESTAMPTZ_C)
            elif self.timezone != self.connection.adapters.get_loader(_TIMESTAMPTZ_OID, pq.Format.TEXT).timezone:
                base.register_tzloader(self.timezone, cursor)  # as Django's create_cursor does
            return self._prepare_cursor(cursor)

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
