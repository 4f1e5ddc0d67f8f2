"""The hot path's CPU in one process, without gunicorn, Celery or a load generator: steadier
than bench/sidebyside.py's whole-system figures on a shared, noisy host, so two versions of
the code can be compared run against run (`--root` points at another checkout).

    .venv/bin/python bench/hotpath_cpu.py [--updates 4000] [--batches 30] [--batch-size 50]
                                          [--statements] [--timings] [--limiter]
                                          [--prefill N] [--root DIR] [--profile FILE]

- webhook: the WSGI application called with `--updates` ~1 KB message updates, one at a time
  (the webhook's view, its INSERT, the wake-up thread's Redis calls): CPU per update.
- router: `--batches` batches of 50 stored updates (`--batch-size 1`: the lone update of a
  quiet bot, as at 20 updates/s), each routed by one in-process call of the
  router (`inbox_updates_route`: the runs, the inline echo and analytics consumers, the
  replies' enqueue and their inline send to the Bot API sandbox over HTTP, the marks): CPU
  per update routed and answered, and the wall-clock time per batch. The rate limiter is off
  (`--limiter`: on, for a bot of 1,000 messages/s; keep batches x size under the 200 chats,
  or a chat's second reply waits its second for the drain) and replies are not debounced.
  Before it the webhook phase's updates are routed and answered unmeasured and the database
  is analyzed, as a deployed bot's is (`--no-analyze`: the plans made for empty tables).

`--prefill N`: the tables hold N updates over 5,000 chats (two consumer runs and a sent reply
each, bench/prefill.py) before the webhook phase, as a deployed bot's do, and each phase
starts after a CHECKPOINT (PostgreSQL makes one every few minutes).

`--timings`: the median wall-clock time of each of a batch's statements (through
core/rows.py, where the hot path's statements go) and of the Python before each: where a
lone update's 8 ms go, round trip by round trip; and the CPU the PostgreSQL backend spent on
each.

CPU is this process's (time.process_time), and apart from it the webhook's PostgreSQL
backend's (from its /proc/<pid>/schedstat: PostgreSQL must run on this host); Redis's and
the sandbox's are not in it. Creates and drops its own database (hotcpu<pid>) and Redis prefix; the sandbox runs
as a subprocess, stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--updates", type=int, default=4000, help="webhook calls measured (after 200 of warm-up)")
parser.add_argument("--batches", type=int, default=30, help="router batches measured (after 2 of warm-up)")
parser.add_argument("--batch-size", type=int, default=50, help="updates per router batch (1: a lone update)")
parser.add_argument("--statements", action="store_true", help="print the SQL statements of one router batch")
parser.add_argument("--timings", action="store_true", help="median time of each statement and the Python between")
parser.add_argument("--profile", type=Path, help="write a cProfile of the router's calls to this file (pstats)")
parser.add_argument("--limiter", action="store_true", help="the rate limiter on, for a bot of 1,000 messages/s")
parser.add_argument(
    "--no-analyze",
    action="store_true",
    help="skip routing the webhook phase's updates and ANALYZE: the plans made for empty tables",
)
parser.add_argument(
    "--prefill",
    type=int,
    default=0,
    help="updates already stored (bench/prefill.py: 2 runs and a reply each); each phase starts after a CHECKPOINT",
)
parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="the checkout to measure")
args = parser.parse_args()

import prefill  # noqa: E402 - this checkout's, whichever --root is measured

ROOT = args.root.resolve()
sys.path.insert(0, str(ROOT / "bench"))
os.chdir(ROOT)
c = importlib.import_module("_common")
sbs = importlib.import_module("sidebyside")

DB = f"hotcpu{os.getpid()}"
TOKEN = "700003:hotpath-cpu-token-abcdefghijklmnopqrstuvwxyz"
SECRET = "hotpath-cpu-webhook-secret"
BATCH = args.batch_size


def call_webhook(application: Any, body: bytes) -> None:
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/webhooks/telegram/dovecote/",
        "SCRIPT_NAME": "",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8000",
        "HTTP_HOST": "127.0.0.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "CONTENT_LENGTH": str(len(body)),
        "CONTENT_TYPE": "application/json",
        "HTTP_X_TELEGRAM_BOT_API_SECRET_TOKEN": SECRET,
    }
    status: list[str] = []
    response = application(environ, lambda s, headers, exc_info=None: status.append(s))
    b"".join(response)
    response.close()
    if not status[0].startswith("200"):
        raise SystemExit(f"the webhook answered {status[0]}")


def body(n: int) -> bytes:
    return json.dumps(sbs.update_body(n, n, sbs.chat_for(n), sbs.update_text(n))).encode()


def backend_cpu() -> Callable[[], int]:
    """The CPU time (ns) the PostgreSQL backend of this thread's connection has used so far,
    from its /proc/<pid>/schedstat (PostgreSQL runs on this host)."""
    from django.db import connection

    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        schedstat = Path(f"/proc/{cursor.fetchone()[0]}/schedstat")
    return lambda: int(schedstat.read_text().split()[0])


def checkpoint() -> None:
    """With --prefill: a phase starts as it would after one of PostgreSQL's checkpoints (every
    few minutes), when each page an insert touches first is written whole into the WAL."""
    if args.prefill:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("CHECKPOINT")


def measure_webhook(updates: int) -> tuple[float, float]:
    """CPU per update: this process's, and its PostgreSQL backend's."""
    from project.wsgi import application

    first = args.prefill + 1  # above the prefilled update ids
    bodies = [body(n) for n in range(first, first + updates + 200)]
    for b in bodies[:200]:
        call_webhook(application, b)
    checkpoint()
    pg = backend_cpu()
    started, pg_started = time.process_time(), pg()
    for b in bodies[200:]:
        call_webhook(application, b)
    return (time.process_time() - started) / updates, (pg() - pg_started) / 1e9 / updates


def measure_router(batches: int) -> tuple[float, float, int, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from bots import inbox, routing
    from bots.models import Bot, InboundUpdate, UpdateState
    from outbox.models import OutboundMessage

    bot = Bot.objects.get()
    if args.no_analyze:
        # The webhook phase's updates are not this phase's work.
        InboundUpdate.objects.filter(state=UpdateState.NEW).update(state=UpdateState.DONE)
    else:
        # As a deployed bot's tables are: thousands of rows in each, and statistics that say
        # so (autovacuum analyzes them). The webhook phase's updates are routed and answered
        # unmeasured, then ANALYZE, which also drops the plans prepared meanwhile.
        while routing.inbox_updates_route(bot.pk, limit=BATCH):
            pass
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
    checkpoint()
    sent_before = OutboundMessage.objects.filter(state="sent").count()
    first = 10**9  # above the webhook phase's update ids
    spent = wall = 0.0
    profile = cProfile.Profile() if args.profile else None
    timed: list[tuple[float, float, int, str]] = []  # (start, end, backend CPU ns, statement) of this batch
    spans: dict[tuple[int, int, str], list[float]] = {}
    pg_spent: list[float] = []  # the backend's CPU for each statement measured
    if args.timings:
        import core.rows

        execute = core.rows._execute
        pg = backend_cpu()

        def timed_execute(*a: Any, **kw: Any) -> Any:
            cpu = pg()
            begun = time.perf_counter()
            try:
                return execute(*a, **kw)
            finally:
                ended = time.perf_counter()
                timed.append((begun, ended, pg() - cpu, " ".join(a[1].split())[:72]))

        core.rows._execute = timed_execute
    for k in range(batches + 2):
        for n in range(first + k * BATCH, first + (k + 1) * BATCH):
            payload = sbs.update_body(n, n, sbs.chat_for(n), sbs.update_text(n))
            inbox.inbox_update_store(bot=bot, payload=payload)
        if profile and k >= 2:
            profile.enable()
        timed.clear()
        started, clock = time.process_time(), time.perf_counter()
        # The query log only when its statements are printed: a deployed router keeps none, and
        # Django's logging cursor costs CPU per statement that the router does not.
        statements = CaptureQueriesContext(connection)
        with statements if args.statements else contextlib.nullcontext():
            routed = routing.inbox_updates_route(bot.pk, limit=BATCH)
        ended = time.perf_counter()
        if k >= 2:
            spent += time.process_time() - started
            wall += ended - clock
            before = clock
            for n, (begun, done, cpu, sql) in enumerate(timed):
                spans.setdefault((n, 0, f"Python, then: {sql}"), []).append(begun - before)
                spans.setdefault((n, 1, "  the statement"), []).append(done - begun)
                spans.setdefault((n, 2, "  PostgreSQL's CPU for it"), []).append(cpu / 1e9)
                pg_spent.append(cpu / 1e9)
                before = done
            spans.setdefault((len(timed), 0, "Python after the last"), []).append(ended - before)
        if profile:
            profile.disable()
        if routed != BATCH:
            raise SystemExit(f"the router took {routed} of {BATCH} updates")
        if args.statements and k == 2:
            print(f"router: {len(statements)} SQL statements for a batch of {BATCH}:")
            for statement in statements:
                print(f"  {statement['time']} s  {statement['sql'][:110]}")
    if profile:
        profile.dump_stats(args.profile)
    if args.timings:
        print(f"router: median wall-clock ms per batch of {BATCH}, in order ({batches} batches):")
        for (n, _, what), values in sorted(spans.items()):
            print(f"  {n:2d} {statistics.median(values) * 1000:7.3f}  {what}")
        total = sum(pg_spent) / (batches * BATCH)
        print(f"router: PostgreSQL's CPU per update routed and answered, {total * 1000:.3f} ms (all its statements)")
    time.sleep(0.5)
    sent = OutboundMessage.objects.filter(state="sent").count() - sent_before
    return spent / (batches * BATCH), wall / batches, sent, (batches + 2) * BATCH


def main() -> None:
    env = c.bench_env(
        DB,
        DEBUG="0",
        SECRET_KEY=f"hotpath-cpu-{DB}-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz",
        ALLOWED_HOSTS="127.0.0.1,localhost",
        CELERY_BROKER_URL=c.bench_env(DB)["REDIS_URL"],
        DOVECOTE_RATE_LIMITS_ENABLED="1" if args.limiter else "0",
        DOVECOTE_REPLY_DEBOUNCE_SECONDS="0",
    )
    sandbox, url = c.start_sandbox(env)
    # With DEBUG off a loopback Bot API host is allowed only as TELEGRAM_API_BASE_URL's.
    env["TELEGRAM_API_BASE_URL"] = url
    try:
        c.setup_database(DB, env)
        add_bot = [str(c.BIN / "python"), "manage.py", "add_bot", "dovecote", "--token", TOKEN]
        add_bot += ["--webhook-secret", SECRET, "--api-base-url", url, "--responder", "echo"]
        add_bot += ["--rate-limit", "1000"] if args.limiter else []
        subprocess.run(add_bot, cwd=ROOT, env=env, check=True, capture_output=True)
        c.django_setup(env)
        if args.prefill:
            from django.db import connection

            with connection.cursor() as cursor:
                cursor.execute("SELECT id FROM bots_bot")
                print(prefill.deployed_tables(cursor, bot_id=cursor.fetchone()[0], rows=args.prefill))
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        print(f"{ROOT} at {head.stdout.strip() or '?'}")
        webhook, webhook_pg = measure_webhook(args.updates)
        print(
            f"webhook: {webhook * 1000:.3f} ms of CPU per update ({args.updates} updates); "
            f"its PostgreSQL backend's: {webhook_pg * 1000:.3f} ms"
        )
        router, wall, sent, routed = measure_router(args.batches)
        print(
            f"router:  {router * 1000:.3f} ms of CPU per update routed and answered, {wall * 1000:.2f} ms per batch "
            f"({args.batches} batches of {BATCH}, limiter {'on' if args.limiter else 'off'}; "
            f"{sent} of {routed} replies sent)"
        )
    finally:
        sandbox.stop(5)
        c.drop_database(DB)


if __name__ == "__main__":
    main()
