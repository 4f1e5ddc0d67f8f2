"""CPU per update of an echo through python-telegram-bot's handlers run by Dovecote (bots/ptb:
python-telegram-bot's own echobot.py, its Application, the request class, the journal, the
persistence) next to the native consumer doing the same (`ctx.reply(ctx.text)`), in one run.

    .venv/bin/python bench/ptb_handlers.py [--updates 300] [--rounds 3]

Each update is stored, routed and its run executed in this process, as a worker's task would
(bots.runs.consumer_run_execute: the claim, the consumer, the reply written and sent to
the Bot API sandbox over HTTP, the done mark); the two consumers take turns, a round of
`--updates` each, one chat per update (no chat's flood limit in the way). Printed: CPU per
update of this process (time.process_time) and of its PostgreSQL backend (/proc schedstat),
each path's median over the rounds, and their ratio. The rate limiter is off. Creates and
drops its own database (ptbhandlers<pid>) and Redis prefix; the sandbox runs as a subprocess,
stopped by PID.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--updates", type=int, default=300, help="updates per path per round (after 20 of warm-up)")
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()

DB = f"ptbhandlers{Path('/proc/self').resolve().name}"
NATIVE, PTB = "bench_native_echo", "bench_ptb_echo"


def register() -> None:
    from bots.ptb import ptb_consumer
    from bots.registry import ConsumerContext, consumer

    @consumer(NATIVE, update_types=["message"], bot="native")
    def native_echo(ctx: ConsumerContext) -> str:
        ctx.reply(ctx.text)
        return "answered"

    ptb_consumer(PTB, bot="ptb", main="tests.ptb.examples.echobot:main")


def measure(bot, consumer: str, first: int, n: int, backend) -> tuple[float, float]:
    """CPU per update (µs) of this process and of its PostgreSQL backend, for n updates."""
    from bots.inbox import inbox_update_store
    from bots.models import ConsumerRun
    from bots.routing import inbox_update_route
    from bots.runs import consumer_run_execute

    cpu, pg = time.process_time(), backend()
    for i in range(first, first + n):
        payload = {
            "update_id": i,
            "message": {
                "message_id": i,
                "date": int(time.time()),
                "chat": {"id": 10_000 + i, "type": "private"},
                "from": {"id": 10_000 + i, "is_bot": False, "first_name": "Ann"},
                "text": f"echo {i}",
            },
        }
        update, _ = inbox_update_store(bot=bot, payload=payload)
        inbox_update_route(update.pk)
        run = ConsumerRun.objects.get(update=update, consumer=consumer)
        outcome = consumer_run_execute(run.pk)
        if outcome != "done":
            raise SystemExit(f"{consumer} on update {i}: {outcome}")
    return (time.process_time() - cpu) / n * 1e6, (backend() - pg) / n


def main() -> None:
    env = c.bench_env(
        DB,
        DOVECOTE_RATE_LIMITS_ENABLED="0",
        DOVECOTE_INLINE_WORK="1",
        DOVECOTE_REPLY_DEBOUNCE_SECONDS="0",
        LOG_LEVEL="ERROR",
    )
    c.setup_database(DB, env)
    procs: list = []
    try:
        sandbox, url = c.start_sandbox(env)
        procs.append(sandbox)
        env["TELEGRAM_API_BASE_URL"] = url
        c.django_setup(env)
        register()
        from django.db import connection

        from bots.models import Bot

        connection.ensure_connection()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
        bots = {
            NATIVE: Bot.objects.create(
                name="native", token="700101:native-echo-abcdefghijklmnopqrstuvwxyz", responder="none"
            ),
            PTB: Bot.objects.create(name="ptb", token="700102:ptb-echo-abcdefghijklmnopqrstuvwxyz", responder="none"),
        }
        results: dict[str, list[tuple[float, float]]] = {NATIVE: [], PTB: []}
        next_id = {NATIVE: 1, PTB: 1}
        for name in (NATIVE, PTB):  # warm-up: the application built, the caches filled
            measure(bots[name], name, next_id[name], 20, lambda: c.backend_cpu_us(pid))
            next_id[name] += 20
        for _ in range(args.rounds):
            for name in (NATIVE, PTB):
                results[name].append(
                    measure(bots[name], name, next_id[name], args.updates, lambda: c.backend_cpu_us(pid))
                )
                next_id[name] += args.updates
        medians = {
            name: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
            for name, rows in results.items()
        }
        print(
            f"CPU per echo, µs (medians of {args.rounds} rounds of {args.updates} updates; "
            "this process / its PostgreSQL backend)"
        )
        for name, (proc, pg) in medians.items():
            rounds = ", ".join(f"{p:.0f}/{b:.0f}" for p, b in results[name])
            print(f"  {name:18} {proc:7.0f} / {pg:5.0f}   (rounds: {rounds})")
        (native, native_pg), (ptb, ptb_pg) = medians[NATIVE], medians[PTB]
        print(f"  ratio ptb / native: {ptb / native:.2f} (process), {(ptb + ptb_pg) / (native + native_pg):.2f} (both)")
    finally:
        c.stop_all(procs, DB)


if __name__ == "__main__":
    main()
