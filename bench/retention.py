"""Benchmark: how fast retention removes old outbox history.

    .venv/bin/python bench/retention.py [--rows 1000000] [--batch 2000] [--budget 20]

Creates its own PostgreSQL database (dovecote_bench_retention, dropped at the end), fills the
outbox with `--rows` sent messages last changed 100 days ago (past the 90-day default), one
attempt each, by INSERT ... SELECT generate_series, then runs retention passes
(reconciliation.retention.retention_pass, as the sweeper does) until nothing old is left, and
prints for each pass the rows it removed, its time, and the rate; then the overall rate.
A message row and its attempt count as two rows removed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DB_NAME = "dovecote_bench_retention"
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}

os.environ.update(
    DJANGO_SETTINGS_MODULE="project.settings",
    DEBUG="1",
    DATABASE_URL=f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}",
    # No Redis key: every pass is due, as when a backlog is left.
    REDIS_URL=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
    DOVECOTE_REDIS_PREFIX="bench-retention:",
    DOVECOTE_RETENTION_INTERVAL_SECONDS="0",
    LOG_LEVEL="WARNING",
)


def admin_sql(statement: str) -> None:
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:
        conn.execute(statement)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=2000, help="DOVECOTE_RETENTION_BATCH_SIZE")
    parser.add_argument("--budget", type=float, default=20.0, help="DOVECOTE_RETENTION_BUDGET_SECONDS")
    args = parser.parse_args()
    os.environ["DOVECOTE_RETENTION_BATCH_SIZE"] = str(args.batch)
    os.environ["DOVECOTE_RETENTION_BUDGET_SECONDS"] = str(args.budget)

    admin_sql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
    admin_sql(f"CREATE DATABASE {DB_NAME}")
    try:
        run(args)
    finally:
        from django.db import connections

        connections.close_all()
        admin_sql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")


def fill(n: int) -> None:
    from django.db import connection
    from django.utils import timezone

    from bots.models import Bot
    from outbox.models import Attempt, OutboundMessage, State

    bot = Bot.objects.create(name="bench", token="123456:AAbench-token-abcdefghijklmnopqrstuvwxyz", rate_limit=30)
    now = timezone.now()
    template = OutboundMessage.objects.create(
        bot=bot,
        chat_id=1,
        idempotency_key="template",
        payload={"parse_mode": "HTML"},
        state=State.SENT,
        sent_at=now,
        next_attempt_at=now,
        attempts=1,
        payload_purged_at=now,
    )
    m, a = OutboundMessage._meta.db_table, Attempt._meta.db_table
    columns = [f.column for f in OutboundMessage._meta.concrete_fields if not f.primary_key]
    # 100 to 101 days old, oldest first by id, as a real history would be.
    when = "now() - interval '100 days' - ((%(n)s - g) || ' seconds')::interval / 12"
    overrides = {
        "idempotency_key": "'hist-' || g",
        "chat_id": "(g %% 50000)",
        "created_at": when,
        "updated_at": when,
        "sent_at": when,
        "payload_purged_at": when,
        "telegram_message_id": "g",
    }
    select = ", ".join(overrides.get(c, f'"{c}"') for c in columns)
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {m} ({', '.join(columns)}) SELECT {select} FROM {m}, generate_series(1, %(n)s) AS g "
            f"WHERE {m}.id = %(template)s",
            {"n": n, "template": template.pk},
        )
        cursor.execute(
            f"INSERT INTO {a} (message_id, number, worker, started_at, finished_at, outcome, http_status, description) "
            f"SELECT id, 1, 'bench:1', sent_at, sent_at, 'ok', 200, '' FROM {m} WHERE id <> %s",
            [template.pk],
        )
    OutboundMessage.objects.filter(pk=template.pk).delete()
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {m}")
        cursor.execute(f"VACUUM ANALYZE {a}")
    print(f"filled {n:,} sent messages + {n:,} attempts in {time.perf_counter() - started:.1f}s", flush=True)


def run(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.core.management import call_command
    from django.utils import timezone

    from outbox.models import Attempt, OutboundMessage
    from reconciliation import retention

    call_command("migrate", verbosity=0)
    fill(args.rows)

    print(f"batch {args.batch:,} rows, budget {args.budget:g} s per pass", flush=True)
    print(f"{'pass':>4} {'messages':>10} {'attempts':>10} {'seconds':>8} {'rows/s':>9}  finished")
    total_rows, total_time, passes, pass_times = 0, 0.0, 0, []
    attempts_left = Attempt.objects.count()
    while True:
        attempts_before = attempts_left
        report: dict[str, int] = {}
        started = time.perf_counter()
        finished = retention.retention_pass(timezone.now(), report)
        elapsed = time.perf_counter() - started
        attempts_left = Attempt.objects.count()
        messages = report.get("messages_pruned", 0)
        attempts = attempts_before - attempts_left
        passes += 1
        total_rows += messages + attempts
        total_time += elapsed
        pass_times.append(elapsed)
        rate = (messages + attempts) / elapsed if elapsed else 0.0
        print(f"{passes:>4} {messages:>10,} {attempts:>10,} {elapsed:>8.2f} {rate:>9,.0f}  {finished}", flush=True)
        if finished:
            break
    left = OutboundMessage.objects.count()
    print()
    print(f"removed {total_rows:,} rows ({args.rows:,} messages + their attempts) in {passes} passes")
    print(f"overall {total_rows / total_time:,.0f} rows/s = {args.rows / total_time:,.0f} messages/s; left: {left}")
    full = pass_times[:-1] or pass_times
    print(f"pass time with a backlog: max {max(full):.2f} s, budget {args.budget:g} s")


if __name__ == "__main__":
    main()
