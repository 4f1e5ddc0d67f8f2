"""Backlog drain: a burst of updates through the webhook leaves replies queued over many
chats; how fast do they leave, against the bot's rate limit, with no celery-beat (the sweeper
not running) or with it?

gunicorn (`project.wsgi`) and one Celery worker (`-c 4`, the Procfile's), the echo responder, a sandbox that
enforces L messages/s per bot and 1/s per private chat (real 429s past them, each sliding
second counted strictly, every request reaching the counters up to `--jitter-ms` late). The
burst: `--updates` message updates over `--chats` chats, posted as fast as the webhook takes
them. Reported: replies per second from the first update to the last reply (a backlog left
for the sweeper shows as a stall at the end), / L, the sends in each 10 s, the 429s received
and the duplicates. Not a test: figures go to docs/PERFORMANCE.md.

    .venv/bin/python bench/backlog.py [--updates 1000] [--chats 100] [--limit 30] [--beat] [--concurrency 4]

Needs PostgreSQL and Redis on 127.0.0.1; creates and drops its own database.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import _common as c
import httpx

DB = f"dovecote_backlog_{os.getpid()}"
TOKEN = "700005:backlog-token-abcdefghijklmnopqrstuvwxyz"
SECRET = "backlog-webhook-secret"


def update(n: int, chats: int) -> dict:
    return c.message_update(n, 500_000 + n % chats, f"bl {n}", first_name="Backlog")


async def burst(url: str, updates: int, chats: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        queue = list(range(1, updates + 1))

        async def connection() -> None:
            while queue:
                status = await c.post_update(client, url, update(queue.pop(0), chats), secret=SECRET)
                statuses[status] = statuses.get(status, 0) + 1

        await asyncio.gather(*(connection() for _ in range(16)))
    return statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--chats", type=int, default=100)
    c.add_procfile_arguments(parser)
    parser.add_argument("--jitter-ms", type=float, default=5.0)
    parser.add_argument("--beat", action="store_true", help="also run celery-beat (the sweeper)")
    args = parser.parse_args()

    env = c.production_env(DB, "backlog")
    c.setup_database(DB, env)
    procs: list[c.Proc] = []
    try:
        sandbox, sandbox_url = c.start_sandbox(
            env, "--bot-rate", str(args.limit), "--private-chat-rate", "1", "--jitter-ms", str(args.jitter_ms)
        )
        procs.append(sandbox)
        env["TELEGRAM_API_BASE_URL"] = sandbox_url
        c.add_bot(env, "backlog", TOKEN, secret=SECRET, api_base_url=sandbox_url, responder="echo", rate=args.limit)
        web, web_url = c.start_web(env)
        procs.append(web)
        procs.append(c.start_worker(env, pool="prefork", concurrency=args.concurrency))
        if args.beat:
            procs.append(c.start_beat(env))
        url = f"{web_url}/webhooks/telegram/backlog/"

        def replies() -> list[dict]:
            calls = c.sandbox_calls(sandbox_url, TOKEN)
            return [
                x for x in calls if x["method"] == "sendMessage" and x["params"].get("text", "").startswith("Echo: bl")
            ]

        # One update first, answered, so that the burst finds the processes up (a worker's
        # children start in seconds on a busy host), as a deployed bot's would be.
        warm = c.message_update(0, 499_999, "warm-up", first_name="Backlog")
        headers = {"X-Telegram-Bot-Api-Secret-Token": SECRET}
        assert httpx.post(url, json=warm, headers=headers, timeout=30).status_code == 200
        c.wait_until(lambda: c.sandbox_calls(sandbox_url, TOKEN), 60, "the warm-up's reply", interval=0.2)
        time.sleep(1.1)  # out of the bot's window

        started = time.time()
        statuses = asyncio.run(burst(url, args.updates, args.chats))
        burst_seconds = time.time() - started

        c.wait_until(
            lambda: sum(1 for x in replies() if x["delivered"]) >= statuses.get(200, 0),
            args.updates / args.limit * 3 + 60,
            "every reply",
            interval=1.0,
        )
        calls = replies()
        delivered = sorted(x["at"] for x in calls if x["delivered"])
        texts = [x["params"].get("text") for x in calls if x["delivered"]]
        refused = sum(1 for x in calls if x["status"] == 429)
        span = delivered[-1] - started
        rate = len(delivered) / span
        per_ten = [0] * (int(span // 10) + 1)
        for at in delivered:
            per_ten[int((at - started) // 10)] += 1
        print(f"burst              {args.updates} updates over {args.chats} chats in {burst_seconds:.1f} s: {statuses}")
        print(f"limit L            {args.limit}/s per bot, 1/s per chat (sandbox and bot.rate_limit)")
        beat = ", beat" if args.beat else ", no beat"
        print(f"processes          web (gunicorn), worker -c {args.concurrency}{beat}")
        print(f"replies            {len(delivered)}, the last one {span:.1f} s after the first update")
        print(f"sends per 10 s     {', '.join(map(str, per_ten))}")
        print(f"achieved rate      {rate:.1f} msg/s = {rate / args.limit:.3f} L from the first update   (aim >= 0.9)")
        print(f"429s received      {refused}   (aim 0)")
        print(f"duplicates         {len(texts) - len(set(texts))}")
        for refusal in (x for x in calls if x["status"] == 429):
            at, chat = refusal["at"], refusal["params"].get("chat_id")
            in_chat = [x["at"] for x in calls if x["delivered"] and x["params"].get("chat_id") == chat]
            previous = max((t for t in in_chat if t < at), default=None)
            bot_window = sum(1 for t in delivered if at - 1.0 < t <= at)
            since = f"{at - previous:.3f} s after the chat's last" if previous else "the chat's first"
            print(f"  a 429 at {at - started:.2f} s: {since}; {bot_window} delivered in the second before it")
    finally:
        for proc in reversed(procs):
            proc.stop()
        c.drop_database(DB)


if __name__ == "__main__":
    main()
