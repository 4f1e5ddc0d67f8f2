"""Webhook throughput: updates stored per second through gunicorn into PostgreSQL.

Compares persistent database connections (CONN_MAX_AGE=600, the default) with a new
connection per request (CONN_MAX_AGE=0). Not a test: figures go to docs/PERFORMANCE.md.

    .venv/bin/python bench/webhook.py [--seconds 10] [--connections 16]

Needs PostgreSQL on 127.0.0.1 (creates and drops the database dovecote_bench_webhook).
The load generator runs in this process (asyncio + httpx), so on 2 cores it competes with
gunicorn for CPU: compare the two rows, not the absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis
from _common import psql

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DB = "dovecote_bench_webhook"
DB_URL = f"postgres://postgres@127.0.0.1:5432/{DB}"
SECRET = "bench-webhook-secret"


def env(conn_max_age: int) -> dict[str, str]:
    return {
        **os.environ,
        "DEBUG": "1",
        "LOG_LEVEL": "WARNING",
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": DB_URL,
        "REDIS_URL": "redis://127.0.0.1:6379/14",
        "DOVECOTE_REDIS_PREFIX": "bench-webhook:",
        "CONN_MAX_AGE": str(conn_max_age),
    }


async def load(url: str, seconds: float, connections: int, ids: itertools.count) -> int:
    done = 0
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"X-Telegram-Bot-Api-Secret-Token": SECRET}
    refused: dict[int, int] = {}
    async with httpx.AsyncClient(limits=limits, timeout=10, headers=headers) as client:

        async def one_connection() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                n = next(ids)
                body = {
                    "update_id": n,
                    "message": {
                        "message_id": n,
                        "date": 0,
                        "chat": {"id": n % 1000 + 1, "type": "private"},
                        "from": {"id": 1, "is_bot": False, "first_name": "A"},
                        "text": "hi",
                    },
                }
                response = await client.post(url, json=body)
                if response.status_code == 200:
                    done += 1
                else:
                    refused[response.status_code] = refused.get(response.status_code, 0) + 1

        await asyncio.gather(*(one_connection() for _ in range(connections)))
    if refused:
        # A bench that measures refusals is measuring nothing: say so.
        raise SystemExit(f"the webhook refused updates: {refused}")
    return done


def measure(conn_max_age: int, seconds: float, connections: int) -> float:
    port = 18000 + conn_max_age % 1000
    web = subprocess.Popen(
        [str(BIN / "gunicorn"), "project.wsgi", "-b", f"127.0.0.1:{port}", "-w", "2", "--threads", "4"],
        cwd=ROOT,
        env=env(conn_max_age),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        url = f"{base}/webhooks/telegram/bench/"
        ids = itertools.count(conn_max_age * 10_000_000 + 1)
        asyncio.run(load(url, 2, connections, ids))  # warm-up
        started = time.monotonic()
        stored = asyncio.run(load(url, seconds, connections, ids))
        return stored / (time.monotonic() - started)
    finally:
        os.killpg(web.pid, signal.SIGTERM)
        web.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--connections", type=int, default=16)
    args = parser.parse_args()
    psql(f"DROP DATABASE IF EXISTS {DB}")
    psql(f"CREATE DATABASE {DB}")
    try:
        setup_env = env(600)
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=setup_env, check=True)
        subprocess.run(
            [
                *(sys.executable, "manage.py", "add_bot", "bench", "--token", "1:bench-token-abcdefghijklmnopqrstu"),
                *("--webhook-secret", SECRET),
            ],
            cwd=ROOT,
            env=setup_env,
            check=True,
            capture_output=True,
        )
        persistent = measure(600, args.seconds, args.connections)
        per_request = measure(0, args.seconds, args.connections)
    finally:
        psql(f"DROP DATABASE IF EXISTS {DB}")
        # The routing tasks the webhook published: nobody consumes them here.

        client = redis.Redis.from_url("redis://127.0.0.1:6379/14")
        keys = list(client.scan_iter("bench-webhook:*"))
        if keys:
            client.delete(*keys)
    print(f"webhook, persistent connections (CONN_MAX_AGE=600): {persistent:8.0f} updates stored/s")
    print(f"webhook, connection per request (CONN_MAX_AGE=0):   {per_request:8.0f} updates stored/s")
    print(f"ratio persistent / per request: {persistent / per_request:.2f}")


if __name__ == "__main__":
    main()
