"""Shared plumbing for the outbox benchmarks: a private database, Redis prefix and queues,
the Bot API sandbox and a Celery worker as subprocesses (stopped by PID, never by name)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A bench stopped by SIGTERM (`timeout`, a CI job) must still stop its worker and
# sandbox and drop its database: Python's default SIGTERM skips the `finally` that does.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

# The same process handling as the test suite: own process group, log file, stop by PID.
from tests.support import Process as Proc  # noqa: E402
from tests.support import free_port  # noqa: E402

BIN = Path(sys.executable).parent


def psql(sql: str) -> None:
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc", sql], check=True, capture_output=True)


def bench_env(db: str, **overrides: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DEBUG": "1",
        "LOG_LEVEL": "WARNING",
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{db}",
        "REDIS_URL": "redis://127.0.0.1:6379/14",
        "DOVECOTE_REDIS_PREFIX": f"{db}:",
        "DOVECOTE_QUEUE_PREFIX": f"{db}.",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(overrides)
    return env


def production_env(db: str, name: str, **overrides: str) -> dict[str, str]:
    """`bench_env` as a deployment runs: DEBUG off (so a secret key and the allowed hosts), and
    workers that stop within a second when the bench ends."""
    return bench_env(
        db,
        DEBUG="0",
        SECRET_KEY=f"{name}-bench-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz",
        ALLOWED_HOSTS="127.0.0.1,localhost",
        CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT="1",
        **overrides,
    )


def add_procfile_arguments(parser: argparse.ArgumentParser) -> None:
    """`--limit` (L, the sandbox's and the bot's rate) and `--concurrency` (the worker's -c)."""
    parser.add_argument("--limit", type=int, default=30, help="L: the sandbox's and the bot's messages/s")
    parser.add_argument("--concurrency", type=int, default=4, help="the worker's -c (the Procfile's default: 4)")


def add_bot(
    env: dict[str, str], name: str, token: str, *, secret: str, api_base_url: str, responder: str, rate: int
) -> None:
    """`manage.py add_bot`, as an operator adds a bot."""
    command = [str(BIN / "python"), "manage.py", "add_bot", name, "--token", token, "--webhook-secret", secret]
    command += ["--api-base-url", api_base_url, "--responder", responder, "--rate-limit", str(rate)]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)


def start_beat(env: dict[str, str]) -> Proc:
    return Proc("beat", [str(BIN / "celery"), "-A", "project", "beat", "-l", "warning"], env)


def message_update(update_id: int, chat: int, text: str, *, first_name: str = "Bench", date: int = 1) -> dict[str, Any]:
    """A private chat's text message, as Telegram delivers it to a webhook."""
    user = {"id": chat, "is_bot": False, "first_name": first_name}
    message = {"message_id": update_id, "from": user, "chat": {**user, "type": "private"}, "date": date, "text": text}
    return {"update_id": update_id, "message": message}


async def post_update(client: httpx.AsyncClient, url: str, update: dict[str, Any], *, secret: str) -> int:
    """POST one update to a webhook as Telegram does (its secret token header); the status.
    A keep-alive connection the server closed is tried again, as Telegram would: the
    update_id makes a second delivery harmless."""
    tries = 3
    while True:
        tries -= 1
        try:
            response = await client.post(url, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": secret})
        except httpx.TransportError:
            if tries == 0:
                raise
        else:
            return response.status_code


def setup_database(db: str, env: dict[str, str]) -> None:
    psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    psql(f"CREATE DATABASE {db}")
    subprocess.run([str(BIN / "python"), "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)


def drop_database(db: str) -> None:
    """Drop the bench's database and its Redis keys (queues, bindings, limiter)."""
    psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    import redis

    client = redis.Redis.from_url(bench_env(db)["REDIS_URL"])
    keys = list(client.scan_iter(f"{db}:*", count=1000))
    if keys:
        client.delete(*keys)


def stop_all(procs: list[Proc], db: str) -> None:
    """A bench's end: its processes stopped (by PID, the last started first), its connections
    closed, its database and Redis keys dropped."""
    for proc in reversed(procs):
        proc.stop()
    from django.db import connections

    connections.close_all()
    drop_database(db)


def django_setup(env: dict[str, str]) -> None:
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


@contextlib.contextmanager
def database_with_bot(db: str, name: str, token: str) -> Iterator[Any]:
    """A migrated database of this bench's own with one bot, Django set up on it (the bot is
    given); its connections closed and the database dropped on the way out."""
    env = bench_env(db)
    setup_database(db, env)
    try:
        django_setup(env)
        from bots.models import Bot

        yield Bot.objects.create(name=name, token=token)
    finally:
        from django.db import connections

        connections.close_all()
        drop_database(db)


def backend_cpu_us(pid: int) -> float:
    """The CPU a PostgreSQL backend has used so far, in µs, from its /proc/<pid>/schedstat
    (PostgreSQL must run on this host)."""
    with open(f"/proc/{pid}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e3


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def start_sandbox(env: dict[str, str], *extra: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc("sandbox", [str(BIN / "python"), "-m", "bots.sandbox.cli", "--port", str(port), *extra], env)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/sandbox/health", 15, "the sandbox")
    return proc, url


def wait_http(url: str, timeout: float, what: str) -> None:
    """Wait until `url` answers 200 (a process just started)."""

    def up() -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout, what)


def start_web(env: dict[str, str]) -> tuple[Proc, str]:
    """gunicorn as the Procfile's `web` runs it (gunicorn.conf.py), on a free port."""
    port = free_port()
    proc = Proc("web", [str(BIN / "gunicorn"), "project.wsgi"], {**env, "BIND": f"127.0.0.1:{port}"})
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz", 30, "the web process")
    return proc, url


def start_worker(env: dict[str, str], *, pool: str, concurrency: int, prefetch: int = 1) -> Proc:
    """A worker at log level warning (per-task info lines would cost as much as the work);
    callers find it ready by sending a warm-up message through it."""
    prefix = env["DOVECOTE_QUEUE_PREFIX"]
    args = [
        str(BIN / "celery"),
        "-A",
        "project",
        "worker",
        "-l",
        "warning",
        "-Q",
        f"{prefix}dovecote,{prefix}dovecote.bulk",
        "-P",
        pool,
        "-c",
        str(concurrency),
        "-n",
        f"bench-{os.getpid()}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--prefetch-multiplier",
        str(prefetch),
    ]
    return Proc("worker", args, env)


def bare_loop(url: str, token: str, n: int) -> float:
    """Messages/s of the same sends, one after another, straight through python-telegram-bot
    (no database): the most a bot's own loop gets from this sandbox on this machine. A 429
    (the sandbox's limit, when the loop is faster) is waited out, as a bot would."""
    import asyncio

    import telegram
    from telegram.error import RetryAfter
    from telegram.request import HTTPXRequest

    async def run() -> float:
        bot = telegram.Bot(token, base_url=f"{url}/bot", request=HTTPXRequest(connection_pool_size=8))
        async with bot:
            await bot.send_message(chat_id=1, text="warm-up")
            start = time.perf_counter()
            for i in range(n):
                try:
                    await bot.send_message(chat_id=10_000 + i, text=f"bare {i}")
                except RetryAfter as exc:
                    wait = exc.retry_after
                    await asyncio.sleep(wait.total_seconds() if hasattr(wait, "total_seconds") else float(wait))
            return time.perf_counter() - start

    return n / asyncio.run(run())


def sandbox_calls(url: str, token: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/sandbox/calls", params={"token": token}, timeout=60)
    return response.json()["calls"]


def _proc_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command, CPU seconds so far), from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        table[int(name)] = (int(fields[1]), command, (int(fields[11]) + int(fields[12])) / tick)
    return table


def cpu_snapshot(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each named process and its descendants, and by all
    PostgreSQL and Redis server processes on the machine (they are shared)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    result: dict[str, float] = {}
    for name, root in groups.items():
        stack, total = [root], 0.0
        while stack:
            pid = stack.pop()
            total += table.get(pid, (0, "", 0.0))[2]
            stack.extend(children.get(pid, []))
        result[name] = total
    result["postgres"] = sum(cpu for _, command, cpu in table.values() if command.startswith("postgres"))
    result["redis"] = sum(cpu for _, command, cpu in table.values() if command.startswith("redis-server"))
    return result


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}
