"""Benchmark: sweeper cost and claim latency with 10k and with 1M outbox rows (mostly sent).

    .venv/bin/python bench/sweeper.py [--large 1000000] [--small 10000]

Creates its own PostgreSQL database (dovecote_bench_sweeper, dropped at the end), fills
the outbox with sent rows by INSERT ... SELECT generate_series, and measures at each size:

- sweep with work: one sweep() that finds 50 overdue pending rows (lost broker messages)
  and 20 sends whose worker died (expired lease), recovers and redispatches them;
- idle sweep: a sweep() that finds nothing to do (the steady state, every 15 s);
- claim: transitions.claim() of one due row (the conditional UPDATE every send starts with).

The aim is that the large/small ratio stays under 2: every query is served by a partial
index over the few live rows, so the sent history does not matter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DB_NAME = "dovecote_bench_sweeper"
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
REDIS_PREFIX = "bench-sweeper:"

os.environ.update(
    DJANGO_SETTINGS_MODULE="project.settings",
    DEBUG="1",
    DATABASE_URL=f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}",
    REDIS_URL=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
    DOVECOTE_REDIS_PREFIX=REDIS_PREFIX,
    DOVECOTE_QUEUE_PREFIX="bench.",
    LOG_LEVEL="WARNING",
)


def admin_sql(statement: str) -> None:
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:
        conn.execute(statement)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    admin_sql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
    admin_sql(f"CREATE DATABASE {DB_NAME}")
    try:
        results = run(args)
    finally:
        from django.db import connections

        connections.close_all()
        admin_sql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        clean_redis()
    small, large = results[args.small], results[args.large]
    print()
    print(f"{'measure':<28}{args.small:>14,}{args.large:>14,}{'ratio':>9}")
    for key in small:
        ratio = large[key] / small[key] if small[key] else float("nan")
        print(f"{key:<28}{small[key]:>12.3f}ms{large[key]:>12.3f}ms{ratio:>9.2f}")


def clean_redis() -> None:
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    keys = list(client.scan_iter(f"{REDIS_PREFIX}*", count=1000))
    if keys:
        client.delete(*keys)


def run(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from bots.models import Bot
    from outbox import transitions
    from outbox.models import OutboundMessage, State
    from reconciliation import sweeper

    call_command("migrate", verbosity=0)
    bot = Bot.objects.create(name="bench", token="123456:AAbench-token-abcdefghijklmnopqrstuvwxyz", rate_limit=30)
    template = OutboundMessage.objects.create(
        bot=bot,
        chat_id=1,
        idempotency_key="template",
        payload={"text": "Your order is confirmed, thank you!"},
        state=State.SENT,
        sent_at=timezone.now(),
        next_attempt_at=timezone.now(),
        attempts=1,
    )
    columns = [f.column for f in OutboundMessage._meta.concrete_fields if not f.primary_key]
    overrides = {
        "idempotency_key": "'hist-' || (g + %(offset)s)",
        "chat_id": "(g %% 50000)",
        "created_at": "now() - (g || ' seconds')::interval",
        "updated_at": "now() - (g || ' seconds')::interval",
        "sent_at": "now() - (g || ' seconds')::interval",
    }

    def fill(upto: int, have: int) -> None:
        started = time.perf_counter()
        select = ", ".join(overrides.get(c, f'"{c}"') for c in columns)
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO outbox_outboundmessage ({', '.join(columns)}) "
                f"SELECT {select} FROM outbox_outboundmessage, generate_series(1, %(n)s) AS g "
                "WHERE outbox_outboundmessage.id = %(template)s",
                {"n": upto - have, "offset": have, "template": template.pk},
            )
            cursor.execute("ANALYZE outbox_outboundmessage")
        print(f"filled to {upto:,} rows in {time.perf_counter() - started:.1f}s", flush=True)

    live_keys = 0

    def live_rows() -> None:
        nonlocal live_keys
        now = timezone.now()
        rows = []
        for _ in range(50):
            live_keys += 1
            rows.append(
                OutboundMessage(
                    bot=bot,
                    chat_id=live_keys,
                    idempotency_key=f"live-{live_keys}",
                    payload={"text": "hi"},
                    next_attempt_at=now - timedelta(minutes=5),
                )
            )
        for _ in range(20):
            live_keys += 1
            rows.append(
                OutboundMessage(
                    bot=bot,
                    chat_id=live_keys,
                    idempotency_key=f"live-{live_keys}",
                    payload={"text": "hi"},
                    state=State.SENDING,
                    next_attempt_at=now,
                    lease_owner="dead:1",
                    lease_expires_at=now - timedelta(seconds=5),
                )
            )
        OutboundMessage.objects.bulk_create(rows)

    def finish_live() -> None:
        # What the workers would have done with them: sent.
        OutboundMessage.objects.filter(idempotency_key__startswith="live-").exclude(state=State.SENT).update(
            state=State.SENT, sent_at=timezone.now(), lease_owner="", lease_expires_at=None
        )

    def measure(size: int) -> dict[str, float]:
        busy, idle, claims = [], [], []
        for _ in range(args.repeat):
            live_rows()
            started = time.perf_counter()
            report = sweeper.sweep()
            busy.append(time.perf_counter() - started)
            assert report["messages_redispatched"] + report["messages_released"] >= 70, report
            finish_live()
            started = time.perf_counter()
            sweeper.sweep()
            idle.append(time.perf_counter() - started)
        for step in sweeper.STEPS:
            times = []
            for _ in range(3):
                started = time.perf_counter()
                step(timezone.now(), defaultdict(int))
                times.append(time.perf_counter() - started)
            print(f"  idle step {step.__name__}: {ms(statistics.median(times))}ms", flush=True)
        now = timezone.now()
        due = OutboundMessage.objects.bulk_create(
            [
                OutboundMessage(
                    bot=bot,
                    chat_id=-i,
                    idempotency_key=f"claim-{size}-{i}",
                    payload={"text": "hi"},
                    next_attempt_at=now,
                )
                for i in range(200)
            ]
        )
        for message in due:
            started = time.perf_counter()
            assert transitions.claim(message.pk, worker="bench:1", lease=timedelta(seconds=60))
            claims.append(time.perf_counter() - started)
        OutboundMessage.objects.filter(pk__in=[m.pk for m in due]).update(
            state=State.SENT, sent_at=timezone.now(), lease_owner="", lease_expires_at=None
        )
        claims.sort()
        result = {
            "sweep with work (median)": ms(statistics.median(busy)),
            "idle sweep (median)": ms(statistics.median(idle)),
            "claim (median)": ms(statistics.median(claims)),
            "claim (p95)": ms(claims[int(len(claims) * 0.95)]),
        }
        print(f"{size:,} rows: {result}", flush=True)
        return result

    results: dict[int, dict[str, float]] = {}
    fill(args.small, 1)
    sweeper.sweep()  # warm up connections and caches
    results[args.small] = measure(args.small)
    fill(args.large, OutboundMessage.objects.count())
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE outbox_outboundmessage")
    sweeper.sweep()
    results[args.large] = measure(args.large)
    return results


if __name__ == "__main__":
    main()
