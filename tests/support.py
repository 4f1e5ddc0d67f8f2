"""Real processes for the tests: Celery workers, gunicorn, the sandbox; and polling helpers."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
# The Authorization header that scrapes /metrics (project/test_settings.py sets the token).
METRICS_AUTH = {"Authorization": f"Bearer {os.environ.get('DOVECOTE_METRICS_TOKEN', 'test-metrics-token')}"}


T = TypeVar("T")


def in_ci() -> bool:
    """CI runs the suite with CI=true (.ci/run's environment, GitHub Actions, GitLab)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_tool(tool: str, found: T, *, install: str, missing: str = "is not installed") -> T:
    """What looking for a test's tool found (a path, a module, True), given back; when it found
    nothing, the test stops with one message naming the tool and how to get it: skipped on a
    developer's machine, failed under CI, where a skip let the run pass with the test never run."""
    if found:
        return found
    message = f"{tool} {missing}: {install}"
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], Any], *, timeout: float = 15.0, interval: float = 0.05, message: str = ""
) -> Any:
    """Poll until predicate() is truthy; return its value, or fail the test with a message."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message or predicate}")
        time.sleep(interval)


class Process:
    """A subprocess in its own process group, with its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"dovecote-{name}-", suffix=".log")[1])
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole group, as a power cut would."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def base_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DOVECOTE_FAILPOINTS"))}
    env.update(
        DJANGO_SETTINGS_MODULE="project.test_settings",
        PYTHONUNBUFFERED="1",
        DEBUG="1",
    )
    env.update(overrides)
    return env


def start_worker(env: dict[str, str], *, pool: str = "prefork", concurrency: int = 2, name: str = "worker") -> Process:
    """A Celery worker on this run's queues, once it is ready; fails the test if it dies first."""
    proc = launch_worker(env, pool=pool, concurrency=concurrency, name=name)
    wait_until(lambda: "ready." in proc.log() or not proc.alive(), timeout=30, message="celery worker ready")
    if not proc.alive():
        raise AssertionError(f"worker died on start:\n{proc.log()}")
    return proc


def launch_worker(env: dict[str, str], *, pool: str = "prefork", concurrency: int = 2, name: str = "worker") -> Process:
    """A Celery worker on this run's queues, not waited for: for a test of how it starts."""
    queues = f"{env['DOVECOTE_QUEUE_PREFIX']}dovecote,{env['DOVECOTE_QUEUE_PREFIX']}dovecote.bulk"
    hostname = f"{name}-{os.getpid()}-{time.monotonic_ns()}@%h"
    return Process(
        name,
        [
            str(VENV_BIN / "celery"),
            "-A",
            "project",
            "worker",
            "-l",
            "info",
            "-Q",
            queues,
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            hostname,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        env,
    )


def start_web(env: dict[str, str], *, name: str = "web") -> tuple[Process, str]:
    port = free_port()
    proc = Process(
        name,
        [
            str(VENV_BIN / "gunicorn"),
            "project.wsgi",
            "-b",
            f"127.0.0.1:{port}",
            "-w",
            "2",
            "--threads",
            "8",
            "--graceful-timeout",
            "2",
        ],
        env,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if not proc.alive():
            raise AssertionError(f"web died on start:\n{proc.log()}")
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30, message="gunicorn ready")
    return proc, url


@dataclass(frozen=True)
class QueuedTask:
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    eta: str | None = None  # ISO time a countdown task runs at


def queued(queue: str | None = None) -> list[QueuedTask]:
    """The tasks waiting in one of this run's broker queues (default: fresh traffic), oldest
    first, read from Redis as kombu stores them."""
    import redis
    from django.conf import settings

    name = f"{settings.DOVECOTE_REDIS_PREFIX}{queue or settings.CELERY_TASK_DEFAULT_QUEUE}"
    tasks = []
    # kombu LPUSHes and the worker BRPOPs: the list's tail is the oldest.
    for raw in reversed(redis.Redis.from_url(settings.REDIS_URL).lrange(name, 0, -1)):
        message = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        headers = message["headers"]
        tasks.append(QueuedTask(headers["task"], args, kwargs, headers.get("eta")))
    return tasks


def point_celery_at(url: str, *, transport_options: dict | None = None, default_queue: str | None = None) -> None:
    """Switch this (the test's) process's Celery app to another broker: the test publishes
    too (enqueues, sweeps). Its connection pool, the producer pool built on it and kombu's
    process-wide pool registries are dropped, or the next publish takes a producer from a
    closed pool ("Acquire on closed pool") and every later test's publishes fail."""
    from kombu import pools

    from core import publishing
    from project.celery import app

    app.conf.broker_url = url
    if transport_options is not None:
        app.conf.broker_transport_options = transport_options
    if default_queue is not None:
        app.conf.task_default_queue = default_queue
    if app._pool is not None:
        app._pool.force_close_all()
        app._pool = None
    app.__dict__.pop("amqp", None)  # its queues, router and producer pool were built for the old one
    pools.reset()
    publishing.reset()


def in_threads(n: int, target: Any, *args: Any) -> list:
    """Run target(i, *args) in n threads released together (a barrier), each with its own
    database connection, closed when done; returns their results in order."""
    import threading

    from django.db import connection

    results: list = [None] * n
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i, *args)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


class PrivateRedis:
    """A redis-server of the test's own on a free port (never the shared one), without
    persistence: a restart loses every queue and key, as a crashed Redis without AOF does."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Process | None = None

    def start(self) -> float:
        """Start it; returns when (time.time()) it took connections."""
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = Process("redis", args, dict(os.environ))
        import redis

        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(up, timeout=10, interval=0.02, message=f"redis-server on port {self.port}")
        return time.time()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.stop()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class HeldEndpoint:
    """An HTTP endpoint (a CRM's, say) that, while `hold` is set, keeps the first POST of each
    Idempotency-Key waiting until `release` is set: a worker is then in the middle of its
    runs. Each POST's key and time (time.time()) are recorded in `posts`."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.posts: list[tuple[str, float]] = []
        self.release = threading.Event()
        self.hold = threading.Event()  # set: first requests wait (after the warm-up)
        posts, release, hold = self.posts, self.release, self.hold

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                key = self.headers.get("Idempotency-Key", "")
                first = all(k != key for k, _ in posts)
                posts.append((key, time.time()))
                if first and hold.is_set():
                    release.wait(120)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/leads"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
