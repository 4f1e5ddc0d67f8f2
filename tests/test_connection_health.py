"""Django's connection health check (CONN_HEALTH_CHECKS), done by project.postgresql without
a round trip when the socket shows nothing wrong, and by Django's `SELECT 1` otherwise."""

from __future__ import annotations

import select
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from django.db import close_old_connections, connection, connections

from bots.models import Bot

pytestmark = pytest.mark.django_db(transaction=True)


def _sent(action: Callable[[], object]) -> list[str]:
    """The statements this connection sent while `action` ran (libpq's protocol trace)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace"
        with path.open("w") as out:
            connection.connection.pgconn.trace(out.fileno())
            try:
                action()
            finally:
                connection.connection.pgconn.untrace()
        lines = [line.split("\t") for line in path.read_text().splitlines()]
    return [
        fields[4].strip()
        for fields in lines
        if len(fields) > 4 and fields[1] == "F" and fields[3] in ("Query", "Parse")
    ]


def _other_connection() -> psycopg.Connection:
    params = connection.get_connection_params()
    return psycopg.connect(
        dbname=params["dbname"],
        user=params.get("user"),
        host=params.get("host"),
        port=params.get("port"),
        autocommit=True,
    )


def _readable_within(seconds: float) -> bool:
    poller = select.poll()
    poller.register(connection.connection.pgconn.socket, select.POLLIN)
    return bool(poller.poll(int(seconds * 1000)))


def test_the_backend_is_djangos_postgresql_with_health_checks_on() -> None:
    assert connection.settings_dict["ENGINE"] == "project.postgresql"
    assert connection.display_name == "PostgreSQL"
    assert connection.health_check_enabled


def test_a_healthy_idle_connection_is_checked_without_a_select_1() -> None:
    Bot.objects.count()  # the connection is open and idle
    close_old_connections()  # what a request's or a task's start does: the next statement checks

    sent = _sent(lambda: Bot.objects.count())

    assert len(sent) == 1
    assert "bots_bot" in sent[0]


def test_a_connection_with_something_to_read_is_asked_with_a_select_1() -> None:
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("LISTEN dovecote_health_test")
    with _other_connection() as other:
        other.execute("NOTIFY dovecote_health_test")
    assert _readable_within(5)
    close_old_connections()

    sent = _sent(lambda: Bot.objects.count())

    assert sent[0] == '"SELECT 1"'
    assert "bots_bot" in sent[1]
    with connection.cursor() as cursor:
        cursor.execute("UNLISTEN *")


def test_a_connection_postgresql_ended_is_replaced_before_the_next_statement() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (old_pid,) = cursor.fetchone()
    with _other_connection() as other:
        other.execute("SELECT pg_terminate_backend(%s)", [old_pid])
    # The server's FATAL message (or its close) reaches the socket.
    assert _readable_within(5)
    close_old_connections()

    started = time.monotonic()
    assert Bot.objects.count() == 0  # no error: the check found it dead and reconnected
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (new_pid,) = cursor.fetchone()

    assert new_pid != old_pid
    assert time.monotonic() - started < 5


def _plan_cache_mode(db) -> str:
    with db.cursor() as cursor:
        cursor.execute("SHOW plan_cache_mode")
        return cursor.fetchone()[0]


def test_a_connection_that_prepares_statements_plans_each_once_and_one_behind_a_pooler_sets_nothing() -> None:
    connection.close()  # a new connection, as a process opens it
    assert _plan_cache_mode(connection) == "force_generic_plan"

    options = {**connection.settings_dict["OPTIONS"], "prepare_threshold": None}
    pooled = type(connections["default"])({**connection.settings_dict, "OPTIONS": options}, "default")
    try:
        # DATABASE_POOLER=transaction: nothing is prepared, so no session state is set.
        assert _plan_cache_mode(pooled) == "auto"
    finally:
        pooled.close()
