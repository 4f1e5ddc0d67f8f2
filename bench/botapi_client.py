"""The Bot API client's own cost: CPU per sendMessage through python-telegram-bot with its
default HTTP layer (`HTTPXRequest`) and with the outbox's (`outbox.telegram_http.AiohttpRequest`),
against the Bot API sandbox over HTTP, `--in-flight` requests at a time (the drain's batch).

    .venv/bin/python bench/botapi_client.py [--requests 2000] [--in-flight 8] [--rounds 2]

"CPU" is this process's CPU time (the sandbox runs in its own process) per request, measured
after a warm-up of 200 requests; the two layers take turns, `--rounds` times each.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import _common as c
import telegram
from telegram.request import BaseRequest, HTTPXRequest

from outbox.telegram_http import AiohttpRequest

TOKEN = "700003:botapi-client-bench-abcdefghijklmnopqrstuvwxyz"
CHATS = 200


async def measure(base_url: str, request: BaseRequest, requests: int, in_flight: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per request."""
    bot = telegram.Bot(TOKEN, base_url=f"{base_url}/bot", request=request)
    await request.initialize()

    async def send(n: int) -> None:
        text = f"echo {n}: " + "lorem ipsum " * 20
        await bot.do_api_request("sendMessage", api_kwargs={"chat_id": 100_000 + n % CHATS, "text": text})

    async def run(first: int, count: int) -> None:
        for start in range(first, first + count, in_flight):
            await asyncio.gather(*(send(n) for n in range(start, start + in_flight)))

    await run(0, 200)
    cpu, wall = time.process_time(), time.perf_counter()
    await run(200, requests)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await request.shutdown()
    return cpu / requests * 1000, wall / requests * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    env = c.bench_env("botapi_client_bench")
    sandbox, url = c.start_sandbox(env)
    layers = {
        "HTTPXRequest (python-telegram-bot's default)": lambda: HTTPXRequest(connection_pool_size=args.in_flight),
        "AiohttpRequest (outbox/telegram_http.py)": lambda: AiohttpRequest(
            connection_pool_size=args.in_flight, connect_timeout=5.0, read_timeout=5.0, pool_timeout=5.0
        ),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in layers}
    try:
        for _ in range(args.rounds):
            for name, make in layers.items():
                results[name].append(asyncio.run(measure(url, make(), args.requests, args.in_flight)))
    finally:
        sandbox.stop(10)
    print(f"{args.requests} sendMessage requests, {args.in_flight} in flight, against the sandbox at {url}")
    print("| HTTP layer | CPU per request (ms) | wall per request (ms) |")
    print("|---|---|---|")
    for name, runs in results.items():
        cpu = " / ".join(f"{c:.3f}" for c, _ in runs)
        wall = " / ".join(f"{w:.3f}" for _, w in runs)
        print(f"| {name} | {cpu} | {wall} |")
    base, ours = (min(c for c, _ in runs) for runs in results.values())
    print(f"CPU per request, aiohttp / httpx: {ours / base:.2f}")


if __name__ == "__main__":
    main()
