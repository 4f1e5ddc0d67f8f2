"""A test run touches only what it made: its own Redis keys and queues, whatever prefix the
environment exports (a developer's shell may hold a deployment's), and its own test database,
never another run's (a run it cannot see: another container, another host sharing the
PostgreSQL server). Checked with a real run of the suite (pytest in a subprocess)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
import redis
from django.conf import settings
from django.db import connection

from tests.support import ROOT, VENV_BIN, base_env


@dataclass(frozen=True)
class NestedRun:
    live_key: str
    other_database: str
    done: subprocess.CompletedProcess


def _server(db: dict) -> psycopg.Connection:
    return psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname="postgres", autocommit=True
    )


def _dead_pid() -> int:
    """The pid of a process that has exited, as a killed run's."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def _env_of_another_run(**exported: str) -> dict[str, str]:
    """A developer's shell: this machine's services, and no trace of this run (its run id would
    make the nested run share this run's test database name)."""
    env = {k: v for k, v in base_env().items() if k not in ("DOVECOTE_TEST_RUN_ID", "DJANGO_SETTINGS_MODULE")}
    env.update(exported)
    return env


@pytest.fixture(scope="module")
def nested_run(django_db_blocker) -> Iterator[NestedRun]:
    db = connection.settings_dict
    prefix = f"live{uuid.uuid4().hex[:8]}:"
    live_key = f"{prefix}dovecote:ratelimit:bot:1"
    other_database = f"test_dovecote_{_dead_pid()}"
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.set(live_key, "a deployment's key")
    with django_db_blocker.unblock(), _server(db) as server:
        server.execute(f'CREATE DATABASE "{other_database}"')
    try:
        done = subprocess.run(
            [str(VENV_BIN / "python"), "-m", "pytest", "tests/test_readme.py", "-q", "-p", "no:cacheprovider"],
            cwd=ROOT,
            env=_env_of_another_run(DOVECOTE_REDIS_PREFIX=prefix, DOVECOTE_QUEUE_PREFIX="live."),
            capture_output=True,
            text=True,
            timeout=240,
        )
        yield NestedRun(live_key, other_database, done)
    finally:
        client.delete(live_key)
        with django_db_blocker.unblock(), _server(db) as server:
            server.execute(f'DROP DATABASE IF EXISTS "{other_database}" WITH (FORCE)')


def test_a_run_leaves_the_keys_under_the_redis_prefix_the_environment_exports(nested_run: NestedRun) -> None:
    assert nested_run.done.returncode == 0, nested_run.done.stdout + nested_run.done.stderr
    assert redis.Redis.from_url(settings.REDIS_URL).get(nested_run.live_key) == b"a deployment's key"


def test_a_run_leaves_a_test_database_named_like_another_runs(nested_run: NestedRun, django_db_blocker) -> None:
    assert nested_run.done.returncode == 0, nested_run.done.stdout + nested_run.done.stderr
    with django_db_blocker.unblock(), _server(connection.settings_dict) as server:
        found = server.execute("SELECT 1 FROM pg_database WHERE datname = %s", [nested_run.other_database])
        assert found.fetchone() == (1,)


@pytest.mark.parametrize(
    ("exported", "prefixes"),
    [
        # A deployment's prefixes, exported in a developer's shell: the run's own instead.
        ({"DOVECOTE_REDIS_PREFIX": "live:", "DOVECOTE_QUEUE_PREFIX": "live."}, ["test4242:", "test4242.dovecote"]),
        ({"DOVECOTE_REDIS_PREFIX": "", "DOVECOTE_QUEUE_PREFIX": ""}, ["test4242:", "test4242.dovecote"]),
        # The RabbitMQ fixture's queues of one test, under the run's own prefix: kept.
        ({"DOVECOTE_QUEUE_PREFIX": "test4242-7."}, ["test4242:", "test4242-7.dovecote"]),
    ],
)
def test_the_run_keeps_its_own_key_and_queue_prefixes_whatever_the_environment_exports(
    exported: dict[str, str], prefixes: list[str]
) -> None:
    env = _env_of_another_run(DJANGO_SETTINGS_MODULE="project.test_settings", DOVECOTE_TEST_RUN_ID="4242", **exported)
    shown = subprocess.run(
        [
            str(VENV_BIN / "python"),
            "-c",
            "import django; django.setup(); from django.conf import settings as s;"
            " print(s.DOVECOTE_REDIS_PREFIX, s.CELERY_TASK_DEFAULT_QUEUE)",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == prefixes
