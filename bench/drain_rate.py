"""Drain rate: messages/s from the outbox to a zero-latency Bot API sandbox, against a bare
loop that calls python-telegram-bot directly with no database (the cost of durability).

Rate limits off (DOVECOTE_RATE_LIMITS_ENABLED=0), one Celery worker. The messages are
written with one bulk INSERT and then dispatched one by one, as each enqueue does after its
commit, so the burst goes through the drain's wake-ups; `--batch 1` switches the drain off
(one task per message) for comparison. Not a test: figures go to docs/PERFORMANCE.md.

    .venv/bin/python bench/drain_rate.py [--messages 1000] [--concurrency 2] [--prefetch 4] [--batch 8]

Needs PostgreSQL and Redis on 127.0.0.1; creates and drops the database dovecote_bench.
The sandbox runs as its own process; its HTTP server and the worker share the 2 cores.
"""

from __future__ import annotations

import argparse

import _common as c
from _common import bare_loop

from outbox import dispatch

DB = "dovecote_bench"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--pool", default="prefork")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=1, help="worker --prefetch-multiplier")
    parser.add_argument(
        "--batch", type=int, default=None, help="DOVECOTE_DRAIN_BATCH_SIZE (1: one message per task, no drain)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the database for inspection")
    args = parser.parse_args()

    overrides = {"DOVECOTE_RATE_LIMITS_ENABLED": "0"}
    if args.batch is not None:
        overrides["DOVECOTE_DRAIN_BATCH_SIZE"] = str(args.batch)
    env = c.bench_env(DB, **overrides)
    c.setup_database(DB, env)
    c.django_setup(env)
    from django.conf import settings
    from django.db import connection
    from django.utils import timezone

    from bots.models import Bot
    from outbox import services
    from outbox.models import Attempt, OutboundMessage, State

    procs: list[c.Proc] = []
    try:
        sandbox, url = c.start_sandbox(env)
        procs.append(sandbox)
        bare_token = "200001:bare-loop-token-abcdefghijklmnopqrstuvwxyz"
        bare_before = bare_loop(url, bare_token, args.messages)

        bot = Bot.objects.create(name="bench", token="200002:bench-token-abcdefghijklmnopqrstuvwxyz", api_base_url=url)
        procs.append(c.start_worker(env, pool=args.pool, concurrency=args.concurrency, prefetch=args.prefetch))
        warm, _ = services.outbound_message_enqueue(
            bot_id=bot.pk, chat_id=1, payload={"text": "warm-up"}, idempotency_key="warm-up"
        )
        c.wait_until(lambda: OutboundMessage.objects.filter(pk=warm.pk, state=State.SENT).exists(), 60, "warm-up")

        now = timezone.now()
        OutboundMessage.objects.bulk_create(
            [
                OutboundMessage(
                    bot=bot,
                    chat_id=10_000 + i,
                    payload={"text": f"outbox {i}"},
                    idempotency_key=f"drain:{i}",
                    next_attempt_at=now,
                )
                for i in range(args.messages)
            ],
            batch_size=1000,
        )
        # As autovacuum would soon after such a load: with no statistics on a fresh table the
        # planner takes the bot_id index for the chat-order check (8 ms a claim, not 0.2).
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {OutboundMessage._meta.db_table}")
        ids = list(OutboundMessage.objects.filter(idempotency_key__startswith="drain:").values_list("pk", flat=True))
        worker = procs[-1]
        cpu_before = c.cpu_snapshot({"sandbox": sandbox.pid, "worker": worker.pid})
        for pk in ids:
            dispatch.dispatch(pk, bot_id=bot.pk)  # as outbound_message_enqueue does after its commit
        c.wait_until(
            lambda: OutboundMessage.objects.filter(pk__in=ids, state=State.SENT).count() == len(ids),
            600,
            "the outbox to drain",
            interval=0.5,
        )
        cpu = c.cpu_used(cpu_before, c.cpu_snapshot({"sandbox": sandbox.pid, "worker": worker.pid}))
        # The bare loop again, after: it swings by half from run to run on a shared machine,
        # and the ratio is taken against the faster of the two.
        bare_after = bare_loop(url, bare_token, args.messages)
        bare = max(bare_before, bare_after)
        attempts = Attempt.objects.filter(message_id__in=ids).order_by("started_at")
        first = attempts.values_list("started_at", flat=True)[0]
        last = OutboundMessage.objects.filter(pk__in=ids).order_by("-sent_at").values_list("sent_at", flat=True)[0]
        outbox = len(ids) / (last - first).total_seconds()
        calls = len(c.sandbox_calls(url, bot.token))
        print(f"messages           {args.messages}")
        print(f"worker             -P {args.pool} -c {args.concurrency} --prefetch-multiplier {args.prefetch}")
        print(f"drain batch        {settings.DOVECOTE_DRAIN_BATCH_SIZE} (1: one message per task)")
        print(f"bare PTB loop      {bare:8.1f} msg/s   (before {bare_before:.1f}, after {bare_after:.1f})")
        print(f"outbox (1 worker)  {outbox:8.1f} msg/s")
        print(f"ratio              {outbox / bare:8.2f}   (aim >= 0.5; against the faster bare run)")
        print("CPU seconds        " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in cpu.items()))
        print(f"sandbox calls      {calls} for {len(ids) + 1} messages (duplicates: {calls - len(ids) - 1})")
        print(f"CPU per message    {sum(cpu.values()) / len(ids) * 1000:.2f} ms (all the processes above)")
    finally:
        for proc in reversed(procs):
            proc.stop()
        from django.db import connections

        connections.close_all()
        if not args.keep:
            c.drop_database(DB)


if __name__ == "__main__":
    main()
