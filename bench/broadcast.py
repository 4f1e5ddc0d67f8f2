"""Broadcast efficiency: N chats through the outbox with the sandbox enforcing a per-bot limit
L (real 429s above it) and the bot configured to L. Reports the achieved rate / L, against
the bare python-telegram-bot send loop on the same sandbox (`--bare`), how long the API took
to accept the broadcast (`--api`), and the 429s received. Not a test: figures go to
docs/PERFORMANCE.md.

    .venv/bin/python bench/broadcast.py [--chats 3000] [--limit 100] [--concurrency 4] [--replies]
        [--jitter-ms 5] [--api] [--bare]

    .venv/bin/python bench/broadcast.py --chats 20000 --limit 1000 --bare   # a paid bot's broadcast
    .venv/bin/python bench/broadcast.py --chats 10000 --limit 1000 --api    # the API accepts 10,000 chats

The sandbox counts every sliding one-second window strictly, each request reaching it up to
`--jitter-ms` late (uniformly), as requests cross a real network. One worker as the Procfile
runs it (`-c 4`, prefetch 1, both queues).

`--api`: the broadcast is posted to `POST /api/v1/broadcasts/` on gunicorn (the Procfile's
`web`), timed from the request to its answer. `--bare`: the same sandbox (another token, its
own window) is driven by python-telegram-bot's own loop, one send after another, before and
after; the aim is 0.9 of min(L, the faster bare run).

`--replies` enqueues one ordinary message per chat instead (`outbound_message_enqueue`, each
committed on its own, as replies are): they go through the bots' drain, not the broadcast's.

Needs PostgreSQL and Redis on 127.0.0.1; creates and drops the database dovecote_bench.
"""

from __future__ import annotations

import argparse
import os
import time

import _common as c
import httpx

DB = f"dovecote_broadcast_{os.getpid()}"
BARE_TOKEN = "200004:bare-loop-token-abcdefghijklmnopqrstuvwxyz"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chats", type=int, default=3000)
    parser.add_argument("--limit", type=int, default=100, help="L: the sandbox's and the bot's messages/s")
    parser.add_argument("--pool", default="prefork")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--replies", action="store_true", help="one ordinary enqueue per chat, not a broadcast")
    parser.add_argument("--api", action="store_true", help="post the broadcast to the REST API (gunicorn)")
    parser.add_argument("--bare", action="store_true", help="also run the bare python-telegram-bot loop")
    parser.add_argument(
        "--jitter-ms", type=float, default=5.0, help="each request reaches the sandbox's strict window up to this late"
    )
    args = parser.parse_args()

    env = c.bench_env(DB)
    c.setup_database(DB, env)
    c.django_setup(env)
    from bots.models import Bot
    from outbox import services
    from outbox.models import OutboundMessage, State

    procs: list[c.Proc] = []
    try:
        sandbox, url = c.start_sandbox(env, "--bot-rate", str(args.limit), "--jitter-ms", str(args.jitter_ms))
        procs.append(sandbox)
        bare_runs = [c.bare_loop(url, BARE_TOKEN, min(args.chats, 3000))] if args.bare else []
        bot = Bot.objects.create(
            name="bench",
            token="200003:broadcast-token-abcdefghijklmnopqrstuvwxyz",
            api_base_url=url,
            rate_limit=args.limit,
        )
        procs.append(c.start_worker(env, pool=args.pool, concurrency=args.concurrency, prefetch=args.prefetch))
        web = None
        if args.api:
            web, web_url = c.start_web(env)
            procs.append(web)
            _, token, _ = services.api_client_add(name="bench-client", bot_names=[bot.name])
        warm, _ = services.outbound_message_enqueue(
            bot_id=bot.pk, chat_id=1, payload={"text": "warm-up"}, idempotency_key="warm-up"
        )
        c.wait_until(lambda: OutboundMessage.objects.filter(pk=warm.pk, state=State.SENT).exists(), 60, "warm-up")
        time.sleep(1.1)  # let the warm-up leave the sandbox's 1 s window

        chat_ids = list(range(100_000, 100_000 + args.chats))
        text = "Our summer sale starts now"
        worker = procs[1]
        cpu_before = c.cpu_snapshot({"sandbox": sandbox.pid, "worker": worker.pid})
        started = time.monotonic()
        if args.replies:
            ids = [
                services.outbound_message_enqueue(
                    bot_id=bot.pk, chat_id=chat_id, payload={"text": "Thanks, we got it"}, idempotency_key=f"r{chat_id}"
                )[0].pk
                for chat_id in chat_ids
            ]
        elif args.api:
            body = {"bot": bot.name, "chat_ids": chat_ids, "payload": {"text": text}}
            headers = {"Authorization": f"Token {token}", "Idempotency-Key": "summer"}
            response = httpx.post(f"{web_url}/api/v1/broadcasts/", json=body, headers=headers, timeout=120)
            assert response.status_code == 201, response.text
            ids = response.json()["message_ids"]
        else:
            ids = services.broadcast_enqueue(
                bot_id=bot.pk, chat_ids=chat_ids, payload={"text": text}, broadcast_key="summer"
            ).message_ids
        enqueue_seconds = time.monotonic() - started
        c.wait_until(
            lambda: OutboundMessage.objects.filter(pk__in=ids, state__in=[State.SENT, State.FAILED]).count()
            == len(ids),
            args.chats / args.limit * 3 + 60,
            "the broadcast to drain",
            interval=0.5,
        )
        cpu = c.cpu_used(cpu_before, c.cpu_snapshot({"sandbox": sandbox.pid, "worker": worker.pid}))
        calls = [x for x in c.sandbox_calls(url, bot.token) if x["method"] == "sendMessage"][1:]
        delivered = sorted(x["at"] for x in calls if x["delivered"])
        refused = sum(1 for x in calls if x["status"] == 429)
        span = delivered[-1] - delivered[0]
        rate = (len(delivered) - 1) / span
        sent = OutboundMessage.objects.filter(pk__in=ids, state=State.SENT).count()
        if args.bare:
            bare_runs.append(c.bare_loop(url, BARE_TOKEN, min(args.chats, 3000)))
        print(f"chats              {args.chats}")
        print(f"limit L            {args.limit}/s (sandbox per-bot limit; bot.rate_limit={args.limit})")
        print(f"worker             -P {args.pool} -c {args.concurrency} --prefetch-multiplier {args.prefetch}")
        how = "enqueues, each committed" if args.replies else "rows: the API's answer" if args.api else "rows"
        print(f"enqueue            {enqueue_seconds:.2f} s for {len(ids)} {how}")
        print(f"sent               {sent}/{len(ids)} in {span:.1f} s")
        print(f"achieved rate      {rate:.1f} msg/s = {rate / args.limit:.3f} L")
        if bare_runs:
            ceiling = min(args.limit, max(bare_runs))
            runs = ", ".join(f"{r:.1f}" for r in bare_runs)
            print(f"bare PTB loop      {max(bare_runs):.1f} msg/s (runs before and after: {runs})")
            print(f"rate / min(L, bare) {rate / ceiling:.3f}   (aim >= 0.9)")
        print(
            "CPU per message    "
            + ", ".join(f"{name} {seconds / len(ids) * 1000:.2f} ms" for name, seconds in cpu.items())
        )
        print(f"429s received      {refused}   (aim 0)")
        print(f"duplicates         {len(delivered) - sent}")
    finally:
        c.stop_all(procs, DB)


if __name__ == "__main__":
    main()
