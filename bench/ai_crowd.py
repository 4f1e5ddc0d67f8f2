"""An AI bot's crowd: N users write within `--spread` seconds, each answer waits `--delay`
seconds for a model; how soon is each answered, against python-telegram-bot in the same run?

- Dovecote at the Procfile's defaults: gunicorn (gunicorn.conf.py), one worker `-c 4`, beat;
  the bot's responder `openai`, pointed at a fake OpenAI-compatible model
  (bots/sandbox/model.py, a process of its own) that sleeps `--delay` and counts the calls in
  flight per caller.
- The peer: python-telegram-bot's webhook bot with `concurrent_updates` and `AIORateLimiter`
  (bench/peers/ptb_ai.py), asking the same model, answering through the same sandbox.

The sandbox enforces L messages/s per bot and 1/s per private chat (real 429s). Updates are
pushed through the sandbox (it POSTs each to the bot's webhook), or with `--direct` POSTed to
the webhook as Telegram does, one per user, evenly over `--spread` seconds. Reported per
system: the last answer after the first update, each update's wait (p50, max), answers per
chat (each exactly once), the model calls in flight at peak (in all, and in the busiest
worker process); for Dovecote also where each update's time went (from the rows), the memory
(PSS) of the worker processes that held the model calls, idle and at peak, and the
PostgreSQL connections their event loops' database threads held (pg_stat_activity's
`dovecote-aio:<pid>`) against DOVECOTE_ASYNC_DB_CONNECTIONS. Not a test: figures go to
docs/AWAITING.md.

    .venv/bin/python bench/ai_crowd.py [--users 60] [--delay 3] [--spread 1] [--limit 30] [--no-peer] [--direct]

Needs PostgreSQL and Redis on 127.0.0.1; creates and drops its own database.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import _common as c
import httpx

DB = f"dovecote_aicrowd_{os.getpid()}"
TOKEN = "700046:aicrowd-token-abcdefghijklmnopqrstuvwxyz"
PEER_TOKEN = "700047:aicrowd-peer-token-abcdefghijklmnopqrstuvwxyz"
SECRET = "aicrowd-webhook-secret"
FIRST_CHAT = 600_000


def start_model(env: dict[str, str], delay: float) -> tuple[c.Proc, str]:
    port = c.free_port()
    args = [str(c.BIN / "python"), "-m", "bots.sandbox.model", "--port", str(port), "--delay", str(delay)]
    proc = c.Proc("model", args, env)
    url = f"http://127.0.0.1:{port}/v1"
    c.wait_http(f"{url}/stats", 15, "the fake model")
    return proc, url


def model_stats(url: str, *, reset: bool = False) -> dict[str, Any]:
    if reset:
        return httpx.post(f"{url}/control", json={"reset": True}, timeout=10).json()
    return httpx.get(f"{url}/stats", timeout=10).json()


async def push_crowd(
    sandbox: str, token: str, users: int, spread: float, text: str, *, webhook: str = ""
) -> dict[int, float]:
    """One message per user, evenly over `spread` seconds: through the sandbox (which POSTs it
    to the bot's webhook), or, given the `webhook` URL, straight to it as Telegram does (the
    sandbox's push is a thread and a request of its own per update). Returns chat -> when
    its push started."""
    pushed: dict[int, float] = {}
    limits = httpx.Limits(max_connections=64 if not webhook else 16)
    gate = asyncio.Semaphore(64 if not webhook else 16)
    async with httpx.AsyncClient(base_url=sandbox, timeout=60, limits=limits) as client:
        start = time.time()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + i * spread / users - time.time()))
            chat = FIRST_CHAT + i
            async with gate:
                pushed[chat] = time.time()
                if webhook:
                    status = await deliver(client, webhook, chat, f"{text} {i}")
                else:
                    body = {"token": token, "chat_id": chat, "text": f"{text} {i}"}
                    response = await client.post("/sandbox/updates", json=body)
                    status = response.json().get("webhook_status")
            if status != 200:
                raise SystemExit(f"the webhook answered {status} for chat {chat}")

        await asyncio.gather(*(one(i) for i in range(users)))
    return pushed


# Far above the sandbox's own update ids (the warm-up's): a repeated id would be a duplicate,
# stored once and never answered again.
_update_ids = iter(range(10**8, 10**9))


async def deliver(client: httpx.AsyncClient, url: str, chat: int, text: str) -> int:
    """One update POSTed to a webhook as Telegram does."""
    update = c.message_update(next(_update_ids), chat, text, first_name="Crowd", date=int(time.time()))
    return await c.post_update(client, url, update, secret=SECRET)


def answers(sandbox: str, token: str, text: str) -> list[dict[str, Any]]:
    return [
        x
        for x in c.sandbox_calls(sandbox, token)
        if x["method"] == "sendMessage"
        and x["delivered"]
        and str(x["params"].get("text", "")).startswith(f"Model: {text}")
    ]


def warm_up(sandbox: str, model: str, token: str) -> None:
    """One question first, answered, so that the crowd finds the processes up; then the
    model's counts start again."""
    asyncio.run(push_crowd(sandbox, token, 1, 0.0, "warm-up"))
    c.wait_until(lambda: answers(sandbox, token, "warm-up"), 60, "the warm-up's answer", interval=0.2)
    time.sleep(2.0)
    model_stats(model, reset=True)


def crowd(
    sandbox: str, token: str, args: argparse.Namespace, webhook: str, floor: float
) -> tuple[dict[int, float], float]:
    """The crowd's questions, each answered (a duplicate would show in the 2 s after the
    last): chat -> when its question was pushed, and how long pushing them all took."""
    pushing = time.time()
    pushed = asyncio.run(push_crowd(sandbox, token, args.users, args.spread, "question", webhook=webhook))
    pushed_in = time.time() - pushing

    def every() -> bool:
        return len(answers(sandbox, token, "question")) >= args.users

    c.wait_until(every, floor * 4 + 60, "every answer", interval=0.5)
    time.sleep(2.0)
    return pushed, pushed_in


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def children(pid: int) -> list[int]:
    return [child for child, (ppid, _, _) in c._proc_table().items() if ppid == pid]


class Sampler:
    """Samples, every 0.2 s until stopped: the worker processes' PSS and the loop's database
    connections per process (pg_stat_activity)."""

    def __init__(self, worker_pid: int) -> None:
        self.pids = children(worker_pid)
        self.idle = {pid: pss_kib(pid) for pid in self.pids}
        self.peak = dict(self.idle)
        self.connections: dict[str, int] = {}
        self.total_connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psycopg

        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
            while not self._stop.wait(0.2):
                for pid in self.pids:
                    self.peak[pid] = max(self.peak[pid], pss_kib(pid))
                rows = conn.execute(
                    "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s GROUP BY 1", [DB]
                ).fetchall()
                self.total_connections = max(self.total_connections, sum(n for _, n in rows))
                for name, n in rows:
                    if name.startswith("dovecote-aio:"):
                        self.connections[name] = max(self.connections.get(name, 0), n)


def report(name: str, pushed: dict[int, float], calls: list[dict[str, Any]], stats: dict[str, Any]) -> float:
    first = min(pushed.values())
    by_chat: dict[int, list[float]] = {}
    for call in calls:
        by_chat.setdefault(int(call["params"]["chat_id"]), []).append(call["at"])
    waits = sorted(min(ats) - pushed[chat] for chat, ats in by_chat.items() if chat in pushed)
    last = max(at for ats in by_chat.values() for at in ats) - first
    once = sum(1 for chat in pushed if len(by_chat.get(chat, [])) == 1)
    twice = sum(1 for ats in by_chat.values() if len(ats) > 1)
    busiest = max(stats["peak_by_caller"].values(), default=0)
    print(f"{name}")
    print(f"  answered           {len(by_chat)} of {len(pushed)} chats; exactly once: {once}; more than once: {twice}")
    print(f"  last answer        {last:.2f} s after the first update")
    print(f"  wait per update    p50 {statistics.median(waits):.2f} s, max {waits[-1]:.2f} s")
    print(f"  model calls        {stats['calls']}; in flight at peak {stats['peak']} (busiest caller {busiest})")
    per_five = [0] * (int(last // 5) + 1)
    for call in calls:
        per_five[int((call["at"] - first) // 5)] += 1
    print(f"  answers per 5 s    {', '.join(map(str, per_five))}")
    return last


def written_per_five(first: float) -> list[int]:
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DB}", autocommit=True) as conn:
        rows = conn.execute("SELECT extract(epoch FROM created_at) FROM outbox_outboundmessage").fetchall()
    times = sorted(float(at) - first for (at,) in rows if float(at) >= first)
    counts = [0] * (int(times[-1] // 5) + 1 if times else 1)
    for at in times:
        counts[int(at // 5)] += 1
    return counts


def stages() -> None:
    """Where each update's time went (from the rows): received -> routed (its run written)
    -> answer written (the model's wait inside) -> sent."""
    import psycopg

    query = """SELECT extract(epoch FROM r.created_at - u.received_at), extract(epoch FROM o.created_at - r.created_at),
                      extract(epoch FROM o.sent_at - o.created_at)
               FROM bots_consumerrun r JOIN bots_inboundupdate u ON u.id = r.update_id
               JOIN outbox_outboundmessage o ON o.source_update_id = u.id
               WHERE r.consumer = 'auto_reply' AND o.sent_at IS NOT NULL"""
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DB}", autocommit=True) as conn:
        rows = conn.execute(query).fetchall()
    for n, name in enumerate(("received -> routed", "routed -> written", "written -> sent")):
        values = sorted(float(row[n]) for row in rows)
        print(f"  {name:<18} p50 {statistics.median(values):.2f} s, max {values[-1]:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=60)
    parser.add_argument("--delay", type=float, default=3.0, help="the model's seconds per answer")
    parser.add_argument("--spread", type=float, default=1.0, help="the users write within this many seconds")
    c.add_procfile_arguments(parser)
    parser.add_argument("--no-peer", action="store_true", help="Dovecote alone")
    parser.add_argument(
        "--direct",
        action="store_true",
        help="POST the updates to the webhooks, as Telegram does, not through the sandbox",
    )
    args = parser.parse_args()

    env = c.production_env(DB, "aicrowd")
    c.setup_database(DB, env)
    procs: list[c.Proc] = []
    try:
        model, model_url = start_model(env, args.delay)
        procs.append(model)
        sandbox, sandbox_url = c.start_sandbox(env, "--bot-rate", str(args.limit), "--private-chat-rate", "1")
        procs.append(sandbox)
        env.update(TELEGRAM_API_BASE_URL=sandbox_url, OPENAI_BASE_URL=model_url)
        c.add_bot(env, "aicrowd", TOKEN, secret=SECRET, api_base_url=sandbox_url, responder="openai", rate=args.limit)
        web, web_url = c.start_web(env)
        worker = c.start_worker(env, pool="prefork", concurrency=args.concurrency)
        beat = c.start_beat(env)
        procs += [web, worker, beat]
        set_webhook = [str(c.BIN / "python"), "manage.py", "set_webhook", "aicrowd", "--url", web_url]
        subprocess.run(set_webhook, cwd=c.ROOT, env=env, check=True, capture_output=True)

        warm_up(sandbox_url, model_url, TOKEN)
        sampler = Sampler(worker.pid).start()
        floor = args.delay + args.users / args.limit
        direct = f"{web_url}/webhooks/telegram/aicrowd/" if args.direct else ""
        pushed, pushed_in = crowd(sandbox_url, TOKEN, args, direct, floor)
        sampler.stop()
        stats = model_stats(model_url)
        print(f"crowd              {args.users} users within {args.spread:g} s; model {args.delay:g} s per answer")
        print(f"limit L            {args.limit}/s per bot, 1/s per private chat (sandbox); floor {floor:.1f} s")
        print(f"processes          web (gunicorn), worker -c {args.concurrency}, beat (the Procfile's)")
        print(f"pushed             every update's webhook answered {pushed_in:.1f} s after the first was sent")
        ours = report("Dovecote (responder openai)", pushed, answers(sandbox_url, TOKEN, "question"), stats)
        written = written_per_five(min(pushed.values()))
        print(f"  written per 5 s    {', '.join(map(str, written))}   (the answers' outbox rows)")
        stages()
        refused = sum(1 for x in c.sandbox_calls(sandbox_url, TOKEN) if x["status"] == 429)
        print(f"  429s received      {refused}")
        loop_pids = {int(name.split(":")[1]) for name in sampler.connections}
        for pid in sorted(loop_pids & set(sampler.idle)):
            idle, peak = sampler.idle[pid], sampler.peak[pid]
            mib = f"PSS idle {idle / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB ({peak / idle:.2f}x)"
            print(f"  worker process {pid}: {mib}")
        bound = int(os.environ.get("DOVECOTE_ASYNC_DB_CONNECTIONS", "2"))
        loop_connections = ", ".join(f"{n} ({name})" for name, n in sorted(sampler.connections.items()))
        print(f"  loop's PG conns    at most {loop_connections or 'none'} per process; bound {bound}")
        print(f"  all PG conns       {sampler.total_connections} at peak (web, worker, beat and their threads)")
        print(f"  aim                last <= 1.2 x floor = {1.2 * floor:.1f} s")
        if args.no_peer:
            return
        for proc in (beat, worker, web):
            proc.stop()
        port = c.free_port()
        peer = c.Proc(
            "ptb-ai",
            [
                str(c.BIN / "python"),
                "bench/peers/ptb_ai.py",
                "--port",
                str(port),
                "--api-base-url",
                sandbox_url,
                "--token",
                PEER_TOKEN,
                "--secret",
                SECRET,
                "--model-url",
                model_url,
            ],
            env,
        )
        procs.append(peer)

        def peer_webhook_set() -> bool:
            calls = c.sandbox_calls(sandbox_url, PEER_TOKEN)
            return any(x["method"] == "setWebhook" for x in calls)

        c.wait_until(peer_webhook_set, 60, "python-telegram-bot's setWebhook", interval=0.2)
        warm_up(sandbox_url, model_url, PEER_TOKEN)
        direct = f"http://127.0.0.1:{port}/ptb-ai" if args.direct else ""
        pushed, _ = crowd(sandbox_url, PEER_TOKEN, args, direct, floor)
        theirs = report(
            "python-telegram-bot, concurrent_updates=256 + AIORateLimiter (in memory)",
            pushed,
            answers(sandbox_url, PEER_TOKEN, "question"),
            model_stats(model_url),
        )
        print(f"ratio              Dovecote's last answer / the peer's = {ours / theirs:.2f}   (aim <= 1.5)")
    finally:
        for proc in reversed(procs):
            proc.stop()
        c.drop_database(DB)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
