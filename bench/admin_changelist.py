"""The outbound-message changelist at a million rows.

    .venv/bin/python bench/admin_changelist.py [--rows 1000000] [--repeat 5]

Creates its own PostgreSQL database (dovecote_bench_admin, dropped at the end), fills the
outbox with `--rows` messages by INSERT ... SELECT generate_series (methods, states, error
classes and trace ids spread over them, 10 bots), ANALYZEs, then renders changelist pages
through Django's test client as a superuser: the plain list, a method filter, an
error-class filter, a trace-id search, and a filter with a search. Prints for each the
median time of `--repeat` renders, its query count and its slowest query; then, for
comparison, the time of the queries the old admin ran on each page load (SELECT DISTINCT
for a filter, DATE_TRUNC for date_hierarchy, UPPER(chat_id::text), icontains on trace id).
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

DB_NAME = "dovecote_bench_admin"
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}

os.environ.update(
    DJANGO_SETTINGS_MODULE="project.settings",
    DEBUG="1",
    DATABASE_URL=f"postgres://{PG['user']}@{PG['host']}:{PG['port']}/{DB_NAME}",
    REDIS_URL=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
    DOVECOTE_REDIS_PREFIX="bench-admin:",
    LOG_LEVEL="WARNING",
)

METHODS = ["sendMessage", "sendPhoto", "sendDocument", "editMessageText", "sendChatAction"]
STATES = ["sent", "sent", "sent", "sent", "failed", "pending", "cancelled"]
ERRORS = ["", "", "", "transient", "permanent", "rate_limited"]


def admin_sql(statement: str) -> None:
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:
        conn.execute(statement)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    admin_sql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
    admin_sql(f"CREATE DATABASE {DB_NAME}")
    try:
        run(args)
    finally:
        from django.db import connections

        connections.close_all()
        admin_sql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")


def _pick(values: list[str], modulus: str) -> str:
    return "(ARRAY[" + ", ".join(f"'{v}'" for v in values) + f"])[({modulus}) %% {len(values)} + 1]"


def fill(n: int) -> None:
    from django.db import connection
    from django.utils import timezone

    from bots.models import Bot
    from outbox.models import OutboundMessage

    bots = [
        Bot.objects.create(name=f"bench{i}", token=f"12345{i}:AAbench-token-abcdefghijklmnopqrstuvwxyz")
        for i in range(10)
    ]
    now = timezone.now()
    template = OutboundMessage.objects.create(
        bot=bots[0], chat_id=1, idempotency_key="template", payload={"text": "hi"}, next_attempt_at=now
    )
    m = OutboundMessage._meta.db_table
    columns = [f.column for f in OutboundMessage._meta.concrete_fields if not f.primary_key]
    when = "now() - ((%(n)s - g) || ' seconds')::interval"
    overrides = {
        "bot_id": f"{bots[0].pk} + g %% 10",
        "idempotency_key": "'hist-' || g",
        "trace_id": "md5(g::text)",
        "chat_id": "(g %% 50000)",
        "method": _pick(METHODS, "g / 7"),
        "state": _pick(STATES, "g"),
        "last_error_class": _pick(ERRORS, "g / 3"),
        "created_at": when,
        "updated_at": when,
        "next_attempt_at": when,
        "sent_at": f"CASE WHEN {_pick(STATES, 'g')} = 'sent' THEN {when} END",
    }
    select = ", ".join(overrides.get(c, f'"{c}"') for c in columns)
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {m} ({', '.join(columns)}) SELECT {select} FROM {m}, generate_series(1, %(n)s) AS g "
            f"WHERE {m}.id = %(template)s",
            {"n": n, "template": template.pk},
        )
    OutboundMessage.objects.filter(pk=template.pk).delete()
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {m}")
    print(f"filled {n:,} outbound messages in {time.perf_counter() - started:.1f}s", flush=True)


def run(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext, setup_test_environment
    from django.urls import reverse

    setup_test_environment()  # the test client's host and a local e-mail backend
    call_command("migrate", verbosity=0)
    fill(args.rows)
    trace = connection.cursor()
    trace.execute("SELECT md5((%s / 2)::text)", [args.rows])
    trace_id = trace.fetchone()[0]

    client = Client()
    client.force_login(get_user_model().objects.create_superuser("bench", "bench@example.com", "x"))
    url = reverse("admin:outbox_outboundmessage_changelist")
    pages = {
        "plain list": {},
        "filter method=sendPhoto": {"method": "sendPhoto"},
        "filter last_error_class=permanent": {"last_error_class": "permanent"},
        "search trace id": {"q": trace_id},
        "filter + search": {"method": METHODS[(args.rows // 2 // 7) % len(METHODS)], "q": trace_id},
    }
    print(f"{'page':<36} {'median ms':>9} {'queries':>7}  slowest query (ms)")
    for name, params in pages.items():
        times, slowest = [], (0.0, "")
        for _ in range(args.repeat):
            with CaptureQueriesContext(connection) as ctx:
                started = time.perf_counter()
                response = client.get(url, params)
                times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, response.status_code
            for q in ctx.captured_queries:
                slowest = max(slowest, (float(q["time"]) * 1000, q["sql"][:70]))
        print(
            f"{name:<36} {statistics.median(times):>9.1f} {len(ctx.captured_queries):>7}  {slowest[0]:.1f} {slowest[1]}"
        )

    m = "outbox_outboundmessage"
    old = {
        "SELECT DISTINCT method (old filter)": f"SELECT DISTINCT method FROM {m} ORDER BY method",
        "DATE_TRUNC year (old date_hierarchy)": f"SELECT DISTINCT DATE_TRUNC('year', created_at) FROM {m}",
        "UPPER(chat_id::text) (old =chat_id)": f"SELECT id FROM {m} WHERE UPPER(chat_id::text) = '4242' LIMIT 101",
        "trace_id icontains (old search)": f"SELECT id FROM {m} "
        f"WHERE UPPER(trace_id::text) LIKE UPPER('%%{trace_id}%%') ORDER BY id DESC LIMIT 101",
        "COUNT(*) (old full result count)": f"SELECT COUNT(*) FROM {m}",
    }
    print(f"\n{'old per-page query':<40} {'ms':>8}")
    with connection.cursor() as cursor:
        for name, sql in old.items():
            started = time.perf_counter()
            cursor.execute(sql.replace("%%", "%"))
            cursor.fetchall()
            print(f"{name:<40} {(time.perf_counter() - started) * 1000:>8.1f}")


if __name__ == "__main__":
    main()
