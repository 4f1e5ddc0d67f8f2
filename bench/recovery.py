"""Back within seconds: after a fault clears, how long until every reply it held up is sent?

Each scenario runs the Procfile's processes at their production defaults - gunicorn (`web`),
one Celery worker (`-c 4` on both queues), celery-beat (the sweeper every 15 s, as the
migration schedules it) - on a PostgreSQL cluster and a redis-server of the bench's own (so
they can be crashed and restarted), with the echo responder and a Bot API sandbox that
enforces 30 messages/s per bot and 1/s per private chat. Users write through the webhook as
Telegram would (an update the webhook did not acknowledge is posted again). Then:

- 502 / 503: the Bot API answers 502 for 8 s (2 messages from each of 100 chats in it) or 503
  for 12 s (4 from each of 5 chats). The 502's backlog is 200 replies, 6.7 s of the bot's
  limit alone: its pace is measured over several of a chat's 1 s turns (it once held 80, sent
  in under 3 s, where one turn of a chat at the end weighed a quarter of the figure);
- 401: the Bot API refuses the token for 8 s (2 from each of 20 chats), then accepts it;
- redis: redis-server is killed and started again 5 s later (without its data, as a Redis
  without persistence restarts), 2 messages from each of 25 chats written while it is down;
- postgres: PostgreSQL crashes (an immediate stop) for 4 s, twice, during a flood of 190
  messages over 19 chats;
- kill: the worker is SIGKILLed while 4 consumer runs (the CRM webhook, to a CRM that takes
  its time) are in flight, and started again at once: when is each run taken over (its
  lease, DOVECOTE_CONSUMER_LEASE_SECONDS, ran out, and the sweeper's tick came)? Aim ~30 s.

Printed per scenario: the replies owed (acknowledged updates), those answered, the first reply
to a message acknowledged before the fault cleared, how long Telegram's limits alone need for
them (a floor of the wait: owed / L, or a chat's replies at 1/s when longer), the backlog's
pace (replies a second from the first sent after the fault to the last, / L), and
the longest wait of a reply after the fault cleared (the 401 from when the API accepts the
token again, the Redis and PostgreSQL ones from when the server takes connections again; a
reply to a message acknowledged later, from then), whether each
chat got its replies in the order its messages were written, and duplicates. Aim: every
reply within 10 s, in order, none twice. Not a test: figures go to docs/PERFORMANCE.md.

    .venv/bin/python bench/recovery.py [--only 502,503,401,redis,postgres,kill]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import _common as c
import httpx
import redis

from tests.private_postgres import PrivatePostgres, remove_clusters_of_dead_runs
from tests.support import HeldEndpoint, PrivateRedis

TOKEN = "700042:recovery-token-abcdefghijklmnopqrstuvwxyz"
SECRET = "recovery-webhook-secret"
LIMIT = 30
SETTLE_SECONDS = 90.0  # how long a scenario waits for its replies after the fault cleared


@dataclass
class Chats:
    """What the users wrote: chat -> texts in the order written; the texts acknowledged."""

    written: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    acknowledged: set[str] = field(default_factory=set)
    acknowledged_at: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_id: int = 1


class Users:
    """Users writing to the bot through its webhook, as Telegram delivers: one update at a
    time per chat, posted again until the webhook acknowledges it."""

    def __init__(self, url: str, chats: Chats) -> None:
        self.url = url
        self.chats = chats
        self.client = httpx.Client(timeout=10, headers={"X-Telegram-Bot-Api-Secret-Token": SECRET})

    def write(self, chat: int, text: str, *, deadline: float = 120.0) -> None:
        with self.chats.lock:
            update_id = self.chats.next_id
            self.chats.next_id += 1
            self.chats.written[chat].append(text)
        user = {"id": chat, "is_bot": False, "first_name": "Recovery"}
        message = {"message_id": update_id, "from": user, "chat": {**user, "type": "private"}, "date": 1, "text": text}
        body = json.dumps({"update_id": update_id, "message": message})
        give_up = time.monotonic() + deadline
        while time.monotonic() < give_up:
            try:
                if self.client.post(self.url, content=body).status_code == 200:
                    with self.chats.lock:
                        self.chats.acknowledged.add(text)
                        self.chats.acknowledged_at[text] = time.time()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # Telegram retries sooner at first; the order per chat is kept

    def write_all(self, per_chat: dict[int, list[str]]) -> None:
        """Each chat's texts in order, the chats side by side."""
        threads = [
            threading.Thread(target=lambda ch=ch, texts=texts: [self.write(ch, t) for t in texts])
            for ch, texts in per_chat.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class System:
    """The Procfile's processes on a database and a Redis of the bench's own."""

    def __init__(self, pg: PrivatePostgres, rds: PrivateRedis, db: str) -> None:
        self.pg, self.redis, self.db = pg, rds, db
        self.procs: list[c.Proc] = []
        self.env = c.bench_env(
            db,
            DEBUG="0",
            SECRET_KEY="recovery-bench-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz",
            ALLOWED_HOSTS="127.0.0.1,localhost",
            DATABASE_URL=pg.url(db),
            REDIS_URL=rds.url,
            CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT="1",
        )

    def start(self) -> tuple[str, str]:
        self.pg.create_database(self.db, template="recovery_template")
        sandbox, sandbox_url = c.start_sandbox(self.env, "--bot-rate", str(LIMIT), "--private-chat-rate", "1")
        self.procs.append(sandbox)
        self.env["TELEGRAM_API_BASE_URL"] = sandbox_url
        add_bot = [str(c.BIN / "python"), "manage.py", "add_bot", "recovery", "--token", TOKEN]
        add_bot += ["--webhook-secret", SECRET, "--api-base-url", sandbox_url, "--responder", "echo"]
        add_bot += ["--rate-limit", str(LIMIT)]
        subprocess.run(add_bot, cwd=c.ROOT, env=self.env, check=True, capture_output=True)
        web, web_url = c.start_web(self.env)
        self.procs.append(web)
        prefix = self.env["DOVECOTE_QUEUE_PREFIX"]
        worker = [str(c.BIN / "celery"), "-A", "project", "worker", "-l", "warning"]
        worker += ["-Q", f"{prefix}dovecote,{prefix}dovecote.bulk", "--concurrency", "4"]
        self.procs.append(c.Proc("worker", worker, self.env))
        beat = [str(c.BIN / "celery"), "-A", "project", "beat", "-l", "warning"]
        beat += ["--scheduler", "django_celery_beat.schedulers:DatabaseScheduler"]
        self.procs.append(c.Proc("beat", beat, self.env))
        return sandbox_url, f"{web_url}/webhooks/telegram/recovery/"

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        if not self.pg.running():
            self.pg.start()
        self.pg.drop_database(self.db)


def replies(sandbox_url: str) -> list[dict]:
    calls = c.sandbox_calls(sandbox_url, TOKEN)
    return [x for x in calls if x["method"] == "sendMessage" and x["delivered"]]


def measure(name: str, fault: str, sandbox_url: str, chats: Chats, cleared: float, *, skip: set[str]) -> dict:
    """Wait for every acknowledged text's reply (or SETTLE_SECONDS), then the figures."""

    def answered() -> set[str]:
        return {x["params"]["text"].removeprefix("Echo: ") for x in replies(sandbox_url)}

    owed = chats.acknowledged - skip
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline and not owed <= answered():
        time.sleep(0.5)
    time.sleep(2.0)  # a duplicate would come now
    calls = [x for x in replies(sandbox_url) if x["params"]["text"].removeprefix("Echo: ") in owed]
    texts = [x["params"]["text"].removeprefix("Echo: ") for x in calls]
    first_call = {}
    for x in calls:
        first_call.setdefault(x["params"]["text"].removeprefix("Echo: "), x["at"])
    # Each reply's wait after the fault cleared, or after its update was acknowledged when
    # that came later (a flood goes on after PostgreSQL's crash).
    waits = sorted(at - max(cleared, chats.acknowledged_at[text]) for text, at in first_call.items())
    held = sorted(
        at - cleared for text, at in first_call.items() if chats.acknowledged_at[text] < cleared and at >= cleared
    )
    in_order = True
    for chat, written in chats.written.items():
        got = [x["params"]["text"].removeprefix("Echo: ") for x in calls if x["params"]["chat_id"] == chat]
        expected = [t for t in written if t in owed and t in set(got)]
        if got and list(dict.fromkeys(got)) != expected:
            in_order = False
    after = sorted(at for at in first_call.values() if at >= cleared)
    # The backlog's pace once it moves: replies per second from the first to the last / L.
    pace = (len(after) - 1) / (after[-1] - after[0]) / LIMIT if len(after) > 1 and after[-1] > after[0] else None
    per_chat = [sum(t in owed for t in written) for written in chats.written.values()]
    return {
        "scenario": name,
        "fault": fault,
        "pace": pace,
        "floor": max(len(owed) / LIMIT, max(per_chat, default=1) - 1),
        "owed": len(owed),
        "answered": len(set(texts)),
        "held": len(held),
        "first": held[0] if held else None,
        "last": waits[-1] if waits else None,
        "slowest": sorted(((at - max(cleared, chats.acknowledged_at[t])), t) for t, at in first_call.items())[-3:]
        + [(None, t) for t in sorted(owed - set(first_call))][:3],
        "in_order": in_order,
        "duplicates": len(texts) - len(set(texts)),
    }


def explain(system: System, texts: list[str]) -> None:
    """Where the slowest replies' rows stood (their update, runs, outbox rows, attempts)."""
    with system.pg.connect(system.db) as conn:
        for text in texts:
            for row in conn.execute(
                "SELECT id, state, updated_at FROM bots_inboundupdate WHERE payload::text LIKE %s", [f"%{text}%"]
            ):
                print(f"  {text!r} update {row}")
                for run in conn.execute(
                    "SELECT id, consumer, state, attempts, last_error, updated_at FROM bots_consumerrun"
                    " WHERE update_id = %s",
                    [row[0]],
                ):
                    print(f"    run {run}")
            for msg in conn.execute(
                "SELECT id, state, attempts, last_error_class, last_error, next_attempt_at, updated_at"
                " FROM outbox_outboundmessage WHERE payload::text LIKE %s",
                [f"%{text}%"],
            ):
                print(f"    message {msg}")
                for a in conn.execute(
                    "SELECT number, started_at, finished_at, outcome, worker FROM outbox_attempt WHERE message_id = %s",
                    [msg[0]],
                ):
                    print(f"      attempt {a}")


def warm_up(users: Users, sandbox_url: str) -> None:
    users.write(1, "warm-up")
    c.wait_until(lambda: replies(sandbox_url), 60, "the warm-up's reply", interval=0.2)
    time.sleep(1.5)


def started(system: System) -> tuple[str, Chats, Users, set[str]]:
    """The system up and answering: the sandbox's URL, the users and what they wrote so far."""
    sandbox_url, url = system.start()
    book = Chats()
    users = Users(url, book)
    warm_up(users, sandbox_url)
    return sandbox_url, book, users, set(book.acknowledged)


def scenario_api(system: System, kind: str, status: int | None, seconds: float, chats: int, per_chat: int) -> dict:
    sandbox_url, book, users, skip = started(system)
    spec: dict = {"kind": kind, "token": TOKEN, "seconds": seconds}
    if status:
        spec["status"] = status
    fault = httpx.post(f"{sandbox_url}/sandbox/faults", json=spec, timeout=10).json()
    cleared = fault["created_at"] + seconds
    users.write_all({10 + ch: [f"{kind} c{ch} m{i}" for i in range(per_chat)] for ch in range(chats)})
    what = f"{status or kind} for {seconds:g} s, {per_chat} per chat in {chats} chats"
    return measure(str(status or kind), what, sandbox_url, book, cleared, skip=skip)


def scenario_redis(system: System) -> dict:
    sandbox_url, book, users, skip = started(system)
    system.redis.kill()
    writing = threading.Thread(
        target=users.write_all, args=({100 + ch: [f"redis c{ch} m{i}" for i in range(2)] for ch in range(25)},)
    )
    writing.start()
    time.sleep(5.0)
    cleared = system.redis.start()
    writing.join()
    return measure("redis", "restarted after 5 s down, 2 per chat in 25 chats", sandbox_url, book, cleared, skip=skip)


def scenario_postgres(system: System) -> dict:
    sandbox_url, book, users, skip = started(system)
    per_chat = {200 + ch: [f"pg c{ch} m{i}" for i in range(10)] for ch in range(19)}

    def flood() -> None:
        # 190 messages over about 19 s: each chat writes one a second.
        threads = []
        for ch, texts in per_chat.items():

            def chat(ch: int = ch, texts: list[str] = texts) -> None:
                for t in texts:
                    users.write(ch, t)
                    time.sleep(1.0)

            threads.append(threading.Thread(target=chat))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    writing = threading.Thread(target=flood)
    writing.start()
    t0 = time.monotonic()
    cleared = 0.0
    for at in (4.0, 12.0):
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        system.pg.crash()
        time.sleep(4.0)
        system.pg.start()
        cleared = time.time()
    writing.join()
    return measure("postgres", "crashed for 4 s, twice, in a flood of 190", sandbox_url, book, cleared, skip=skip)


def scenario_kill(system: System) -> dict:
    """The worker SIGKILLed while 4 CRM runs wait for the CRM's answer, started again at once
    (as a supervisor would): when is each run taken over (its CRM request made again)?"""
    crm = HeldEndpoint()
    system.env["DOVECOTE_CRM_WEBHOOK_URL"] = crm.url
    try:
        _, _, users, _ = started(system)
        c.wait_until(lambda: crm.posts, 60, "the warm-up's CRM run", interval=0.05)
        crm.posts.clear()
        crm.hold.set()
        # As many runs as the worker has processes, each waiting for the CRM's answer.
        users.write_all({300 + ch: [f"kill c{ch}"] for ch in range(4)})
        c.wait_until(lambda: len(crm.posts) >= 4, 60, "the CRM runs to start", interval=0.05)
        worker = next(p for p in system.procs if p.name == "worker")
        worker.kill()
        killed = time.time()
        crm.release.set()
        system.procs.remove(worker)
        system.procs.append(c.Proc("worker", worker.proc.args, system.env))
        keys = {k for k, _ in crm.posts}
        c.wait_until(lambda: all(sum(k == key for k, _ in crm.posts) >= 2 for key in keys), 120, "the runs again", 0.2)
        again = [min(at for k, at in crm.posts[len(keys) :] if k == key) - killed for key in keys]
        if os.environ.get("RECOVERY_EXPLAIN"):
            print([(k[-12:], round(at - killed, 1)) for k, at in crm.posts])
            for proc in system.procs:
                print(f"--- {proc.name}: {proc.log_path}")
        return {
            "scenario": "kill",
            "fault": f"worker SIGKILLed with {len(keys)} runs in flight (restarted at once)",
            "owed": len(keys),
            "answered": len(keys),
            "held": len(keys),
            "first": min(again),
            "last": max(again),
            "slowest": [],
            "in_order": True,
            "duplicates": 0,
        }
    finally:
        crm.close()


def main() -> None:
    global SETTLE_SECONDS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="502,503,401,redis,postgres,kill")
    parser.add_argument("--settle", type=float, default=SETTLE_SECONDS, help="the longest wait for the replies")
    args = parser.parse_args()
    chosen = args.only.split(",")
    SETTLE_SECONDS = args.settle
    remove_clusters_of_dead_runs()
    pg = PrivatePostgres().init()
    pg.start()
    rds = PrivateRedis()
    rds.start()
    results = []
    try:
        pg.create_database("recovery_template")
        pg.migrate("recovery_template")
        for name in chosen:
            system = System(pg, rds, f"recovery_{name}")
            try:
                if name == "502":
                    results.append(scenario_api(system, "5xx", 502, 8.0, chats=100, per_chat=2))
                elif name == "503":
                    results.append(scenario_api(system, "5xx", 503, 12.0, chats=5, per_chat=4))
                elif name == "401":
                    results.append(scenario_api(system, "401", None, 8.0, chats=20, per_chat=2))
                elif name == "redis":
                    results.append(scenario_redis(system))
                elif name == "postgres":
                    results.append(scenario_postgres(system))
                elif name == "kill":
                    results.append(scenario_kill(system))
                r = results[-1]
                if os.environ.get("RECOVERY_EXPLAIN") and (r["last"] or 0) > 10:
                    explain(system, [t for _, t in r["slowest"]])
                    for proc in system.procs:
                        lines = [ln for ln in proc.log().splitlines() if "WARNING" in ln or "ERROR" in ln]
                        print(f"--- {proc.name}: {proc.log_path}")
                        print("\n".join(ln[:300] for ln in lines[-30:]))
            finally:
                system.stop()
                redis.Redis.from_url(rds.url).flushall()
            r = results[-1]
            print(json.dumps(r), flush=True)
    finally:
        rds.stop()
        pg.stop()
    print()
    print(
        "| fault | replies answered | first reply after it cleared | every reply within | the limits alone | pace / L |"
        " in order | twice |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        first = "-" if r["first"] is None else f"{r['first']:.1f} s"
        last = "-" if r["last"] is None else f"{r['last']:.1f} s"
        pace = "-" if r.get("pace") is None else f"{r['pace']:.2f}"
        floor = "-" if r.get("floor") is None else f"{r['floor']:.1f} s"
        print(
            f"| {r['fault']} | {r['answered']}/{r['owed']} | {first} | {last} | {floor} | {pace}"
            f" | {'yes' if r['in_order'] else 'NO'} | {r['duplicates']} |"
        )


if __name__ == "__main__":
    main()
