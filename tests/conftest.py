"""Fixtures: real PostgreSQL (pytest-django's test database), real Redis (db 15), the Bot API
sandbox over HTTP, and real Celery workers and gunicorn as subprocesses."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.test import override_settings

from bots.models import Bot
from bots.routing import inbox_router_wakes_flush
from bots.sandbox.client import SandboxClient
from bots.sandbox.server import SandboxServer
from core import publishing
from outbox import ratelimit
from tests.support import Process, base_env, point_celery_at, require_tool, start_web, start_worker

_bot_numbers = itertools.count(1)


def _delete_run_keys(client: redis.Redis) -> None:
    # Only this run's keys: another run (a developer's, CI's) may share the Redis.
    keys = list(client.scan_iter(f"{settings.DOVECOTE_REDIS_PREFIX}*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(autouse=True)
def _clean_redis() -> Iterator[None]:
    """Each test starts with an empty broker queue and limiter (this run's Redis keys)."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    _delete_run_keys(client)
    ratelimit._storage.cache_clear()
    ratelimit._limiter.cache_clear()
    publishing.reset()
    yield
    # A webhook request's router wake-up leaves from a thread (bots/routing.py): let it land
    # in this test's keys, not the next test's.
    inbox_router_wakes_flush(timeout=5)
    _delete_run_keys(client)


@pytest.fixture(autouse=True)
def _hop_by_hop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests run with production's inline work (DOVECOTE_INLINE_WORK on). One marked
    `hop_by_hop` drives each hop itself (store, route, run, send: tests/bots/fakes.py), so
    for it the router runs no consumer and a run's worker sends nothing it wrote."""
    if request.node.get_closest_marker("hop_by_hop") is None:
        yield
        return
    with override_settings(DOVECOTE_INLINE_WORK=False):
        yield


@pytest.fixture(scope="session")
def sandbox_server() -> Iterator[SandboxServer]:
    server = SandboxServer(port=0)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def sandbox(sandbox_server: SandboxServer) -> Iterator[SandboxClient]:
    client = SandboxClient(sandbox_server.base_url)
    client.reset()
    yield client
    client.reset()


def make_bot(sandbox_url: str, **fields: object) -> Bot:
    n = next(_bot_numbers)
    defaults: dict[str, object] = {
        "name": f"bot{n}",
        "token": f"{100000 + n}:AAtest-token-{n:04d}-abcdefghijklmnopqrstuvwxyz",
        "api_base_url": sandbox_url,
        "responder": "echo",
        "rate_limit": 30,
    }
    defaults.update(fields)
    return Bot.objects.create(**defaults)


@pytest.fixture
def bot(db: None, sandbox_server: SandboxServer) -> Bot:
    return make_bot(sandbox_server.base_url)


@pytest.fixture
def bot_factory(db: None, sandbox_server: SandboxServer):
    return lambda **fields: make_bot(sandbox_server.base_url, **fields)


@pytest.fixture
def process_env(transactional_db: None, sandbox_server: SandboxServer) -> dict[str, str]:
    """Environment for worker and web subprocesses: this test database, Redis db 15."""
    db = connection.settings_dict
    return base_env(
        DATABASE_URL=f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        REDIS_URL=settings.REDIS_URL,
        TELEGRAM_API_BASE_URL=sandbox_server.base_url,
        DOVECOTE_REPLY_DEBOUNCE_SECONDS="0",
    )


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    """Processes a test starts; stopped (by PID) when it ends."""
    started: list[Process] = []
    yield started
    for proc in started:
        proc.stop()


@pytest.fixture
def worker(process_env: dict[str, str], processes: list[Process]) -> Process:
    proc = start_worker(process_env)
    processes.append(proc)
    return proc


@pytest.fixture
def web(process_env: dict[str, str], processes: list[Process]) -> str:
    proc, url = start_web(process_env)
    processes.append(proc)
    return url


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--seed",
        action="append",
        type=int,
        default=[],
        help="run tests/e2e/test_fault_schedules.py with this seed (repeatable) instead of its fixed seeds",
    )


RABBITMQ_URL = os.environ.get("DOVECOTE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _point_celery_at(url: str, transport_options: dict, default_queue: str) -> None:
    point_celery_at(url, transport_options=transport_options, default_queue=default_queue)


@pytest.fixture
def broker(request: pytest.FixtureRequest, process_env: dict[str, str]) -> Iterator[str]:
    """Parametrize with `indirect=True` over "redis" and "amqp": the broker of the workers and
    web processes the test starts, and of this process. Redis keeps the limiter and the keys
    either way. On RabbitMQ each test gets its own queue names (no key prefix there), so that
    parallel runs never consume each other's tasks; they are deleted afterwards."""
    kind = getattr(request, "param", "redis")
    if kind == "redis":
        yield kind
        return
    from kombu import Connection

    try:
        with Connection(RABBITMQ_URL, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # any reason RabbitMQ is not there
        require_tool(
            "RabbitMQ",
            False,
            missing=f"is not reachable at {RABBITMQ_URL} ({exc})",
            install="`make services` installs Debian's rabbitmq-server and starts it",
        )
    prefix = f"{settings.DOVECOTE_REDIS_PREFIX.rstrip(':')}-{next(_bot_numbers)}."
    queues = [f"{prefix}dovecote", f"{prefix}dovecote.bulk"]
    process_env.update(CELERY_BROKER_URL=RABBITMQ_URL, DOVECOTE_QUEUE_PREFIX=prefix)
    before = (
        settings.CELERY_BROKER_URL,
        dict(settings.CELERY_BROKER_TRANSPORT_OPTIONS),
        settings.CELERY_TASK_DEFAULT_QUEUE,
    )
    overrides = override_settings(
        CELERY_BROKER_URL=RABBITMQ_URL,
        CELERY_BROKER_TRANSPORT_OPTIONS={},
        CELERY_TASK_DEFAULT_QUEUE=queues[0],
        CELERY_TASK_QUEUE_BULK=queues[1],
    )
    overrides.enable()
    _point_celery_at(RABBITMQ_URL, {}, queues[0])
    try:
        yield kind
    finally:
        overrides.disable()
        _point_celery_at(*before)
        with Connection(RABBITMQ_URL, connect_timeout=2) as conn:
            channel = conn.channel()
            # Passive: raises if the worker never declared its queue on RabbitMQ.
            channel.queue_declare(queues[0], passive=True)
            for name in queues:
                channel.queue_delete(name)
                channel.exchange_delete(name)
