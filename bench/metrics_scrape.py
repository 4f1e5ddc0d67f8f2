"""Benchmark: what one /metrics scrape costs on a big outbox.

    .venv/bin/python bench/metrics_scrape.py [--rows 1000000] [--bots 10] [--scrapes 30]

Creates its own PostgreSQL database (dovecote_bench_metrics, dropped at the end), makes
`--bots` bots and fills the outbox with `--rows` messages spread over them by INSERT ...
SELECT generate_series: 1% waiting (pending, retry, sending), 0.2% failed with an open dead
letter each, the rest sent (one attempt each, as a real history has), over the last 90 days
(the default retention; --days to change). Then it scrapes
/metrics (Django's test client, with the bearer token) `--scrapes` times and prints the
number of SQL queries of one scrape and the median / p95 / max time; then the same for the
admin dashboard's numbers (reconciliation.dashboard.dashboard_numbers, overall and per bot).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DB_NAME = "dovecote_bench_metrics"
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
TOKEN = "bench-metrics-token"

os.environ.update(
    DJANGO_SETTINGS_MODULE="project.settings",
    DEBUG="1",
    DATABASE_URL=f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}",
    REDIS_URL=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
    DOVECOTE_REDIS_PREFIX="bench-metrics:",
    DOVECOTE_METRICS_TOKEN=TOKEN,
    ALLOWED_HOSTS="testserver",
    LOG_LEVEL="WARNING",
)


def admin_sql(statement: str) -> None:
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:
        conn.execute(statement)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--bots", type=int, default=10)
    parser.add_argument("--scrapes", type=int, default=30)
    parser.add_argument("--days", type=float, default=90, help="days the history spans")
    args = parser.parse_args()
    admin_sql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
    admin_sql(f"CREATE DATABASE {DB_NAME}")
    try:
        run(args)
    finally:
        from django.db import connections

        connections.close_all()
        admin_sql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")


def fill(n: int, bots: int, days: float) -> None:
    from django.db import connection
    from django.utils import timezone

    from bots.models import Bot
    from outbox.models import Attempt, DeadLetter, OutboundMessage, State

    first = None
    for i in range(bots):
        bot = Bot.objects.create(name=f"bench{i}", token=f"{100000 + i}:AAbench-token-abcdefghijklmnopqrstuvwxyz")
        first = first or bot
    now = timezone.now()
    template = OutboundMessage.objects.create(
        bot=first,
        chat_id=1,
        idempotency_key="template",
        payload={"text": "x"},
        state=State.PENDING,
        next_attempt_at=now,
    )
    m, a, d = OutboundMessage._meta.db_table, Attempt._meta.db_table, DeadLetter._meta.db_table
    columns = [f.column for f in OutboundMessage._meta.concrete_fields if not f.primary_key]
    # Spread evenly over the last 90 days (the default retention), oldest first by id.
    when = "now() - interval '1 day' * %(days)s * (%(n)s - g) / %(n)s"
    # g % 1000: 0-3 pending, 4-6 retry, 7-9 sending, 10-11 failed, the rest sent.
    state = (
        "CASE WHEN g %% 1000 < 4 THEN 'pending' WHEN g %% 1000 < 7 THEN 'retry' WHEN g %% 1000 < 10 THEN 'sending'"
        " WHEN g %% 1000 < 12 THEN 'failed' ELSE 'sent' END"
    )
    overrides = {
        "bot_id": f"(SELECT min(id) FROM bots_bot) + g %% {bots}",
        "idempotency_key": "'hist-' || g",
        "chat_id": "(g %% 50000)",
        "state": state,
        "created_at": when,
        "updated_at": when,
        "next_attempt_at": when,
        "sent_at": f"CASE WHEN g %% 1000 >= 12 THEN {when} END",
        "lease_owner": "CASE WHEN g %% 1000 BETWEEN 7 AND 9 THEN 'bench' ELSE '' END",
        "lease_expires_at": "CASE WHEN g %% 1000 BETWEEN 7 AND 9 THEN now() + interval '1 minute' END",
        "telegram_message_id": "g",
    }
    select = ", ".join(overrides.get(c, f'"{c}"') for c in columns)
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {m} ({', '.join(columns)}) SELECT {select} FROM {m}, generate_series(1, %(n)s) AS g "
            f"WHERE {m}.id = %(template)s",
            {"n": n, "days": days, "template": template.pk},
        )
        cursor.execute(f"DELETE FROM {m} WHERE id = %s", [template.pk])
        cursor.execute(
            f"INSERT INTO {a} (message_id, number, worker, started_at, finished_at, outcome, http_status, description) "
            f"SELECT id, 1, 'bench:1', created_at, created_at, 'ok', 200, '' FROM {m} WHERE state = 'sent'"
        )
        cursor.execute(
            f"""INSERT INTO {d} (bot_id, message_id, consumer, reason_class, first_error, last_error, trace_id,
                  chat_id, idempotency_key, status, resolution_note, created_at)
                SELECT bot_id, id, '', CASE WHEN id % 2 = 0 THEN 'permanent' ELSE 'exhausted' END, 'x', 'x', '',
                  chat_id, idempotency_key, 'open', '', updated_at FROM {m} WHERE state = 'failed'"""
        )
        for table in (m, a, d):
            cursor.execute(f"VACUUM ANALYZE {table}")
    elapsed = time.perf_counter() - started
    print(f"filled {n:,} messages over {bots} bots and {days:g} days (+ attempts, dead letters) in {elapsed:.1f}s")


def timed(label: str, fn, repeat: int) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    fn()  # warm: connection, imports
    times, queries = [], 0
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1000)
        queries = len(captured)
    times.sort()
    p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
    print(
        f"{label}: {queries} queries; median {statistics.median(times):.1f} ms, p95 {p95:.1f} ms, "
        f"max {times[-1]:.1f} ms ({repeat} runs)",
        flush=True,
    )


def run(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.core.management import call_command
    from django.test import Client

    from bots.models import Bot
    from reconciliation.dashboard import dashboard_numbers

    call_command("migrate", verbosity=0)
    fill(args.rows, args.bots, args.days)
    client = Client()

    def scrape() -> None:
        response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200, response.status_code

    timed("/metrics scrape", scrape, args.scrapes)

    def dashboard() -> None:
        dashboard_numbers()
        for pk in Bot.objects.values_list("pk", flat=True):
            dashboard_numbers(pk)

    timed("dashboard numbers (overall + each bot)", dashboard, max(3, args.scrapes // 10))


if __name__ == "__main__":
    main()
