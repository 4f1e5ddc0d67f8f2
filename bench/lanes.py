"""Replies while a bot broadcasts: how long its users, and other bots' users, wait for an
answer while one bot sends a broadcast, against the same load without it, and how fast the
broadcast goes meanwhile. Not a test: figures go to docs/PERFORMANCE.md.

    .venv/bin/python bench/lanes.py [--chats 3000] [--limit 30] [--others 5] [--rate 2] [--quiet 30]

The Procfile's processes at their defaults: gunicorn (`web`), one worker (`-c 4`, both
queues), beat (the sweeper every 15 s); the echo responder. A sandbox enforcing L messages/s
per bot and 1/s per private chat, each sliding second counted strictly, every request
reaching the counters up to `--jitter-ms` late. One bot broadcasts; it and `--others` other
bots (each at L too) get `--rate` message updates/s each through the webhook, over 100 chats
per bot (the broadcasting bot's users are among the broadcast's chats).

First `--quiet` seconds of that load alone, then the same load while the broadcast (posted
to `POST /api/v1/broadcasts/`) is sent, until its last message. Reported per group: replies'
p50/p99/max, from the update's POST to the reply's arrival at the sandbox; the broadcast's
rate against L less the rate its bot's replies took; the 429s received.

Needs PostgreSQL and Redis on 127.0.0.1; creates and drops its own database.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time

import _common as c
import httpx

DB = f"dovecote_lanes_{os.getpid()}"
SECRET = "lanes-webhook-secret"
TEXT = "Our summer sale starts now"


class Load:
    """`rate` updates/s to each bot's webhook, spread evenly; when each text was posted."""

    def __init__(self, web_url: str, bots: list[str], chats: dict[str, list[int]], rate: float) -> None:
        self.web_url, self.bots, self.chats, self.rate = web_url, bots, chats, rate
        self.posted: dict[str, tuple[str, float]] = {}  # text -> (bot, time.time() at the POST)
        self.statuses: dict[int, int] = {}
        self._ids = itertools.count(1)

    async def run(self, seconds: float | None, until: asyncio.Event | None = None) -> None:
        headers = {"X-Telegram-Bot-Api-Secret-Token": SECRET}
        async with httpx.AsyncClient(timeout=30, headers=headers) as client:
            await asyncio.gather(*(self._bot(client, bot, seconds, until) for bot in self.bots))

    async def _bot(self, client: httpx.AsyncClient, bot: str, seconds: float | None, until: asyncio.Event | None):
        start = time.monotonic()
        chats = itertools.cycle(self.chats[bot])
        for k in itertools.count():
            at = start + k / self.rate
            if (seconds is not None and at - start > seconds) or (until is not None and until.is_set()):
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            n = next(self._ids)
            text = f"lanes {bot} {n}"
            self.posted[text] = (bot, time.time())
            body = json.dumps(c.message_update(n, next(chats), text, first_name="Lanes"))
            response = await client.post(f"{self.web_url}/webhooks/telegram/{bot}/", content=body)
            self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1


def waits(load: Load, calls: list[dict], since: float, until: float) -> dict[str, list[float]]:
    """Seconds from each update's POST (within [since, until]) to its echo's arrival, by bot."""
    answered: dict[str, float] = {}
    for call in calls:
        text = call["params"].get("text", "")
        if call["delivered"] and text.startswith("Echo: "):
            for line in text[len("Echo: ") :].splitlines():
                answered.setdefault(line, call["at"])
    by_bot: dict[str, list[float]] = {}
    for text, (bot, posted) in load.posted.items():
        if since <= posted <= until:
            by_bot.setdefault(bot, []).append(answered.get(text, float("inf")) - posted)
    return by_bot


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def line(name: str, values: list[float]) -> str:
    lost = sum(1 for v in values if v == float("inf"))
    ok = [v for v in values if v != float("inf")] or [float("nan")]
    return (
        f"{name:<34} n={len(values):4d}  p50 {statistics.median(ok):6.3f} s  p99 {pct(values, 0.99):6.3f} s"
        f"  max {max(values):7.3f} s{f'  unanswered {lost}' if lost else ''}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=3000, help="the broadcast's chats")
    parser.add_argument("--limit", type=int, default=30, help="L: every bot's messages/s (sandbox and rate_limit)")
    parser.add_argument("--others", type=int, default=5, help="other bots whose users write meanwhile")
    parser.add_argument("--rate", type=float, default=2.0, help="updates/s per bot")
    parser.add_argument("--quiet", type=float, default=30.0, help="seconds of the load without the broadcast")
    parser.add_argument("--jitter-ms", type=float, default=5.0)
    args = parser.parse_args()

    env = c.production_env(DB, "lanes")
    c.setup_database(DB, env)
    c.django_setup(env)
    from django.db.models import Count

    from bots.models import Bot
    from outbox import services
    from outbox.models import OutboundMessage, State

    procs: list[c.Proc] = []
    try:
        sandbox, sandbox_url = c.start_sandbox(
            env, "--bot-rate", str(args.limit), "--private-chat-rate", "1", "--jitter-ms", str(args.jitter_ms)
        )
        procs.append(sandbox)
        env["TELEGRAM_API_BASE_URL"] = sandbox_url  # with DEBUG off, the one Bot API host allowed
        names = ["broadcaster"] + [f"other{n}" for n in range(1, args.others + 1)]
        bots = {
            name: Bot.objects.create(
                name=name,
                token=f"{800000 + n}:lanes-token-{n:04d}-abcdefghijklmnopqrstuvwxyz",
                api_base_url=sandbox_url,
                responder="echo",
                rate_limit=args.limit,
                webhook_secret=SECRET,
            )
            for n, name in enumerate(names)
        }
        chat_ids = list(range(100_000, 100_000 + args.chats))
        # The broadcaster's users are among its broadcast's chats; the others' are their own.
        chats = {name: [100_000 + 30 * k + n for k in range(100)] for n, name in enumerate(names)}
        chats.update({name: [900_000 + 1000 * n + k for k in range(100)] for n, name in enumerate(names) if n})
        web, web_url = c.start_web(env)
        procs.append(web)
        procs.append(c.start_worker(env, pool="prefork", concurrency=4))
        procs.append(c.start_beat(env))
        _, token, _ = services.api_client_add(name="lanes-client", bot_names=["broadcaster"])

        load = Load(web_url, names, chats, args.rate)
        asyncio.run(load.run(3.0))  # warm-up: every bot's router, the worker's processes and connections

        def warm() -> bool:
            calls = [x for bot in bots.values() for x in c.sandbox_calls(sandbox_url, bot.token)]
            return all(waits(load, calls, 0.0, time.time())[name][-1] < float("inf") for name in names)

        c.wait_until(warm, 60, "the warm-up's replies", interval=0.5)
        time.sleep(1.0)
        quiet_start = time.time()
        asyncio.run(load.run(args.quiet))
        quiet_end = time.time()
        time.sleep(3.0)

        async def during() -> tuple[float, float, float]:
            done = asyncio.Event()
            loader = asyncio.create_task(load.run(None, done))
            await asyncio.sleep(1.0)
            posted = time.time()
            body = {"bot": "broadcaster", "chat_ids": chat_ids, "payload": {"text": TEXT}}
            headers = {"Authorization": f"Token {token}", "Idempotency-Key": "summer"}
            async with httpx.AsyncClient(timeout=120) as client:
                response = await client.post(f"{web_url}/api/v1/broadcasts/", json=body, headers=headers)
            accepted = time.time() - posted
            assert response.status_code == 201, response.text
            ids = response.json()["message_ids"]
            deadline = time.monotonic() + args.chats / args.limit * 3 + 120
            while time.monotonic() < deadline:
                left = await asyncio.to_thread(
                    lambda: OutboundMessage.objects.filter(pk__in=ids).exclude(state=State.SENT).count()
                )
                if not left:
                    break
                await asyncio.sleep(1.0)
            done.set()
            await loader
            return posted, accepted, time.time()

        posted, accepted, finished = asyncio.run(during())
        time.sleep(5.0)  # the last replies
        calls = {
            name: [x for x in c.sandbox_calls(sandbox_url, bot.token) if x["method"] == "sendMessage"]
            for name, bot in bots.items()
        }
        broadcast = sorted(x["at"] for x in calls["broadcaster"] if x["delivered"] and x["params"].get("text") == TEXT)
        if len(broadcast) < 2:
            states = dict(
                OutboundMessage.objects.filter(bot=bots["broadcaster"]).values_list("state").annotate(Count("id"))
            )
            raise SystemExit(f"the broadcast did not go out: {states}; logs: {[p.log_path for p in procs]}")
        span = broadcast[-1] - broadcast[0]
        broadcast_rate = (len(broadcast) - 1) / span
        echoes = [x["at"] for x in calls["broadcaster"] if x["delivered"] and x["params"]["text"].startswith("Echo: ")]
        reply_rate = sum(1 for at in echoes if broadcast[0] <= at <= broadcast[-1]) / span
        refused = {name: sum(1 for x in mine if x["status"] == 429) for name, mine in calls.items()}
        everything = [x for mine in calls.values() for x in mine]
        quiet = waits(load, everything, quiet_start, quiet_end)
        busy = waits(load, everything, posted, broadcast[-1])
        others = [n for n in names if n != "broadcaster"]

        print(f"bots               1 broadcaster + {args.others} others, L = {args.limit}/s each, 1/s per chat, strict")
        print(f"load               {args.rate}/s updates per bot; webhook answers {load.statuses}")
        print("processes          web (gunicorn), worker -c 4, beat (sweep every 15 s), as the Procfile")
        print(f"API                accepted {args.chats} chats in {accepted:.2f} s")
        print(f"broadcast          {len(broadcast)} sent in {span:.1f} s = {broadcast_rate:.1f}/s;")
        room = args.limit - reply_rate
        print(f"                   its bot's replies took {reply_rate:.1f}/s: L - that = {room:.1f}/s")
        ratio = broadcast_rate / room
        print(f"broadcast / (L - replies) {ratio:.3f}   (aim >= 0.9)")
        print("replies, update POST -> reply at the sandbox:")
        print("  " + line("broadcaster's users, no broadcast", quiet.get("broadcaster", [])))
        print("  " + line("broadcaster's users, broadcasting", busy.get("broadcaster", [])))
        quiet_others = [v for n in others for v in quiet.get(n, [])]
        busy_others = [v for n in others for v in busy.get(n, [])]
        print("  " + line("other bots' users, no broadcast", quiet_others))
        print("  " + line("other bots' users, broadcasting", busy_others))
        if quiet_others and busy_others:
            print(
                f"other bots' p99 broadcasting / quiet  {pct(busy_others, 0.99) / pct(quiet_others, 0.99):.2f}   "
                "(aim <= 1.5)"
            )
        print(f"broadcaster's p99 broadcasting        {pct(busy.get('broadcaster', [0.0]), 0.99):.3f} s   (aim <= 2)")
        print(f"429s received      {sum(refused.values())}   (aim 0) {refused if any(refused.values()) else ''}")
        print(f"broadcast done     {finished - posted:.1f} s after the POST")
    finally:
        c.stop_all(procs, DB)


if __name__ == "__main__":
    main()
