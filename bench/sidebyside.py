"""Side by side: Dovecote against a bare Django view and python-telegram-bot's own webhook echo
bot, one after another, against the same Bot API sandbox (over HTTP) and the same load.

    .venv/bin/python bench/sidebyside.py [--seconds 10] [--only bare,ptb,dovecote] [--e2e-seconds 15] [--rounds 1]
                                         [--no-analyze]

Systems:
- bare: a Django view that parses the JSON and does one `INSERT … ON CONFLICT DO NOTHING`
  (bench/peers/bare_view.py), gunicorn 2 processes x 4 threads, persistent connections.
- ptb: python-telegram-bot's `Application.run_webhook` echo bot, in memory
  (bench/peers/ptb_echo.py), its Bot pointed at the sandbox.
- dovecote: `gunicorn project.wsgi` (gunicorn.conf.py, as the Procfile runs it) and one
  `celery -A project worker -P prefork -c 2`, DEBUG=0, a bot added with
  `manage.py add_bot … --api-base-url <sandbox> --responder echo` and a webhook secret.
  Measured three times on fresh copies of one migrated database: the webhook alone (no
  worker), the whole system (web + worker), and the end-to-end latency.

Load: ~1 KB `message` updates over 200 chats with unique update_ids, `wrk -t 2 -c 32` for
`--seconds` (after 2 s of warm-up), through a Lua script this bench writes; without wrk, an
asyncio + httpx load generator in this process (it says so). "CPU per update" is the
utime + stime of the system's own process trees (gunicorn master and workers, the Celery
worker and its children, the PTB process) over the measured run, divided by the updates
handled: for the bare view and the webhook alone the updates stored, for PTB and the whole of
Dovecote the updates echoed (the bench waits until the sandbox has received every reply).
PostgreSQL and Redis are not counted in the table but shown below it, per update: the
PostgreSQL backends connected to the system's own database, and the redis-server on
127.0.0.1:6379 (shared with whatever else uses it). "e2e" sends updates at a steady 20/s for
`--e2e-seconds` and measures from just before each POST to the sandbox receiving the echo
that carries the update's unique token (the sandbox's recorded `at`).

Dovecote's rate limiter is switched off (DOVECOTE_RATE_LIMITS_ENABLED=0) for the throughput
run, as for the other two systems: with Telegram's 30 messages/s per bot a burst of
thousands of updates would take minutes to answer. The e2e run keeps the limiter on (the
production default): 20 updates/s over 200 chats is under every limit.

Needs PostgreSQL (trust auth, user postgres) and Redis on 127.0.0.1, wrk (Debian's package)
and tornado for PTB's webhook (installed by `make` from requirements-dev.txt). Creates and
drops its own databases (sbs<pid>_*) and Redis keys (db 14, prefix sbs<pid>_*); every process
it starts runs in its own process group and is stopped by PID, also on Ctrl-C or SIGTERM.
The machine's 2 cores are shared by the load generator, the sandbox, PostgreSQL and the
system measured: compare rows within one run, not absolute figures across machines.
After the warm-up of each throughput run, the system's database is analyzed, as autovacuum
would have analyzed a deployed bot's tables long before (`--no-analyze` skips it: the
measured run then executes the plans PostgreSQL prepared for empty tables).
`--rounds N` runs the whole sequence N times and prints, after each round's table, every
target's figure in each round and their median: a shared host's speed moves between the
systems' runs, minutes apart, and the spread of the rounds shows by how much.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as c
import httpx

RUN = f"sbs{os.getpid()}"
SECRET = "sidebyside-webhook-secret"
CHATS = 200
THREADS = 2
CONNECTIONS = 32
WARMUP_SECONDS = 2
ANALYZE_AFTER_WARMUP = True  # --no-analyze: measure with the plans made for empty tables
E2E_RATE = 20
# The paid-broadcast run: a bot allowed 1,000 messages/s, 100 updates/s over 1,500 chats.
PAID_RATE_LIMIT = 1000
PAID_E2E_RATE = 100
PAID_CHATS = 1500
# Waiting for replies gives up once none has come for this long.
STALL_SECONDS = 30.0
PTB_TOKEN = "700001:ptb-echo-token-abcdefghijklmnopqrstuvwxyz"
DOVECOTE_TOKEN = "700002:dovecote-token-abcdefghijklmnopqrstuvwxyz"
REDIS_URL = "redis://127.0.0.1:6379/14"
BARE_TABLE_SQL = (
    "CREATE TABLE bare_update (update_id bigint PRIMARY KEY, payload jsonb NOT NULL, "
    "received_at timestamptz NOT NULL DEFAULT now())"
)
HEADERS = {"Content-Type": "application/json", "X-Telegram-Bot-Api-Secret-Token": SECRET}
# Each load run gets its own block of update_ids: unique within a database and across runs.
ID_BLOCK = 10**12
ID_THREAD_STRIDE = 10**10
FILLER = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore "
    "et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut "
    "aliquip ex ea commodo consequat. Duis aute irure dolor in reprehenderit in voluptate velit esse cillum "
    "dolore eu fugiat nulla pariatur. Excepteur sint occaecat cupidatat non proident, sunt in culpa qui "
    "officia deserunt mollit anim id est laborum. Sed ut perspiciatis unde omnis iste natus error sit "
    "voluptatem accusantium doloremque laudantium, totam rem aperiam, eaque ipsa quae ab illo inventore."
)[:560]


# ----------------------------------------------------------------------------- the update
def update_body(update_id: int, message_id: int, chat_id: int, text: str) -> dict[str, Any]:
    """A Telegram `message` update as a private chat's user sends it (~1 KB as JSON)."""
    user = {
        "id": chat_id,
        "is_bot": False,
        "first_name": "Bench",
        "last_name": "User",
        "username": f"bench_user_{chat_id}",
        "language_code": "en",
    }
    chat = {k: user[k] for k in ("id", "first_name", "last_name", "username")} | {"type": "private"}
    return {
        "update_id": update_id,
        "message": {
            "message_id": message_id,
            "from": user,
            "chat": chat,
            "date": int(time.time()),
            "text": text,
            "entities": [{"offset": 0, "length": 3, "type": "bold"}],
        },
    }


def update_text(update_id: int | str) -> str:
    return f"sbs {update_id} {FILLER}"


def chat_for(n: int, chats: int = CHATS, first: int = 100_000) -> int:
    return first + n % chats


# ------------------------------------------------------------------------------- the load
@dataclass
class Load:
    requests: int
    ok: int
    seconds: float
    errors: dict[str, int]
    generator: str

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0


_SENTINELS = {"uid": 911_000_000_000_111, "mid": 922_222, "chat": 933_333}


def lua_script(base: int) -> str:
    """A wrk script that POSTs `update_body` with a unique update_id per request: the block
    `base`, plus the thread's number times a stride, plus the thread's own counter."""
    template = json.dumps(
        update_body(_SENTINELS["uid"], _SENTINELS["mid"], _SENTINELS["chat"], update_text(_SENTINELS["uid"])),
        separators=(",", ":"),
    )
    names = {str(v): k for k, v in _SENTINELS.items()}
    pieces = re.split("(" + "|".join(names) + ")", template)
    parts = [names.get(p, f"[==[{p}]==]") for p in pieces if p]
    headers = ", ".join(f'["{k}"] = "{v}"' for k, v in HEADERS.items())
    return f"""
local base = {base}
local stride = {ID_THREAD_STRIDE}
local chats = {CHATS}
local headers = {{{headers}}}
local counter = 0
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

function request()
  counter = counter + 1
  local uid = string.format("%.0f", base + tid * stride + counter)
  local mid = string.format("%d", counter)
  local chat = string.format("%d", 100000 + (counter + tid * 101) % chats)
  local body = {" .. ".join(parts)}
  return wrk.format("POST", nil, headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("SIDEBYSIDE %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.status, e.connect, e.read, e.write, e.timeout))
end
"""


def run_wrk(url: str, seconds: int, base: int) -> Load:
    with tempfile.NamedTemporaryFile("w", prefix=f"{RUN}-", suffix=".lua", delete=False) as f:
        f.write(lua_script(base))
    try:
        args = ["wrk", "-t", str(THREADS), "-c", str(CONNECTIONS), "-d", f"{seconds}s", "--timeout", "10s"]
        # subprocess.run kills wrk if this process is interrupted.
        out = subprocess.run(
            [*args, "-s", f.name, url], capture_output=True, text=True, timeout=seconds + 60, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    line = next((x for x in out.splitlines() if x.startswith("SIDEBYSIDE ")), None)
    if line is None:
        raise SystemExit(f"wrk printed no summary:\n{out}")
    requests, duration_us, status, connect, read, write, timeout = map(int, line.split()[1:])
    errors = {"non-2xx": status, "connect": connect, "read": read, "write": write, "timeout": timeout}
    return Load(requests, requests - status, duration_us / 1e6, {k: v for k, v in errors.items() if v}, "wrk")


async def _httpx_load(url: str, seconds: float, base: int) -> Load:
    """The fallback without wrk: CONNECTIONS keep-alive connections from this process."""
    counter = iter(range(1, 10**9))
    done, ok, errors = 0, 0, Counter[str]()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    async with httpx.AsyncClient(limits=limits, timeout=10, headers=HEADERS) as client:

        async def connection() -> None:
            nonlocal done, ok
            while time.monotonic() < deadline:
                n = next(counter)
                body = json.dumps(update_body(base + n, n, chat_for(n), update_text(base + n))).encode()
                try:
                    response = await client.post(url, content=body)
                except httpx.HTTPError as exc:
                    errors[type(exc).__name__] += 1
                    continue
                done += 1
                if response.status_code == 200:
                    ok += 1
                else:
                    errors[f"HTTP {response.status_code}"] += 1

        started = time.monotonic()
        await asyncio.gather(*(connection() for _ in range(CONNECTIONS)))
        elapsed = time.monotonic() - started
    return Load(done, ok, elapsed, dict(errors), "asyncio+httpx")


class Loader:
    def __init__(self) -> None:
        self.wrk = shutil.which("wrk") is not None
        self.blocks = iter(range(1, 10**6))

    def describe(self) -> str:
        if self.wrk:
            return f"wrk -t {THREADS} -c {CONNECTIONS}"
        return (
            f"asyncio+httpx, {CONNECTIONS} connections, in this process (wrk not found: "
            "`apt-get install -y wrk`); slower than wrk and it competes for the same 2 cores"
        )

    def run(self, url: str, seconds: float) -> Load:
        base = next(self.blocks) * ID_BLOCK
        if self.wrk:
            return run_wrk(url, max(1, round(seconds)), base)
        return asyncio.run(_httpx_load(url, seconds, base))


# ------------------------------------------------------------------------- the sandbox
class Echoes:
    """The sandbox's delivered sendMessage calls for one token, read incrementally."""

    def __init__(self, sandbox: str, token: str) -> None:
        self.sandbox, self.token = sandbox, token
        self.count = 0
        self.last_id = 0
        self.last_at = 0.0

    def poll(self) -> list[dict[str, Any]]:
        params = {"token": self.token, "method": "sendMessage", "delivered": "1", "after": str(self.last_id)}
        calls = httpx.get(f"{self.sandbox}/sandbox/calls", params=params, timeout=60).json()["calls"]
        if calls:
            self.last_id = max(call["id"] for call in calls)
            self.last_at = max(self.last_at, *(call["at"] for call in calls))
            self.count += len(calls)
        return calls

    def wait_for(
        self,
        count: int,
        on_calls: Callable[[list[dict[str, Any]]], None] | None = None,
        progress: Callable[[], int] | None = None,
    ) -> bool:
        """Poll until `count` echoes have come; give up once neither the echoes nor
        `progress()` (the system's own count of work done, if given) have moved for
        STALL_SECONDS: a slow system still working is waited for, a stuck one is not."""
        seen, progress_seen, moved = self.count, progress() if progress else 0, time.monotonic()
        checked = moved
        while True:
            calls = self.poll()
            if on_calls is not None:
                on_calls(calls)
            if self.count >= count:
                return True
            if self.count != seen:
                seen, moved = self.count, time.monotonic()
            elif progress is not None and time.monotonic() - checked > 2.0:
                checked = time.monotonic()
                done = progress()
                if done != progress_seen:
                    progress_seen, moved = done, checked
            if time.monotonic() - moved > STALL_SECONDS:
                return False
            time.sleep(0.2)

    def settle(self, count: int, progress: Callable[[], int] | None = None, quiet: float = 1.0) -> bool:
        """Wait for `count` echoes, then until none has come for `quiet` seconds (the
        replies to requests still in flight when the load generator stopped)."""
        complete = self.wait_for(count, progress=progress)
        seen, since = self.count, time.monotonic()
        while time.monotonic() - since < quiet:
            time.sleep(0.2)
            self.poll()
            if self.count != seen:
                seen, since = self.count, time.monotonic()
        return complete


def sandbox_reset(sandbox: str) -> None:
    httpx.post(f"{sandbox}/sandbox/reset", timeout=30).raise_for_status()


# ------------------------------------------------------------------------------ e2e
_E2E_TOKEN = re.compile(r"e2e-\d+-\d+")


async def _steady(
    url: str, rate: float, seconds: float, base: int, chats: int = CHATS, first_chat: int = 100_000
) -> tuple[dict[str, float], Counter[str]]:
    """POST one update every 1/rate s (each in its own task, so a slow answer delays no
    other); return the wall-clock time just before each was sent, by its text's token."""
    sent: dict[str, float] = {}
    outcomes = Counter[str]()
    async with httpx.AsyncClient(timeout=10, headers=HEADERS) as client:

        async def one(i: int) -> None:
            token = f"e2e-{base}-{i}"
            chat = chat_for(i, chats, first_chat)
            body = json.dumps(update_body(base + i, i + 1, chat, f"{token} {FILLER}")).encode()
            sent[token] = time.time()
            try:
                response = await client.post(url, content=body)
                outcomes[str(response.status_code)] += 1
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] += 1

        started = time.monotonic()
        tasks = []
        for i in range(round(rate * seconds)):
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return sent, outcomes


@dataclass
class Latency:
    p50_ms: float
    p99_ms: float
    sent: int
    answered: int
    outcomes: dict[str, int]
    # By token: (sent, the sandbox's receipt), wall-clock seconds; for the stage breakdown.
    times: dict[str, tuple[float, float]] = field(default_factory=dict)
    stages: list[tuple[str, float]] = field(default_factory=list)
    # The slowest echoes: (total ms, each stage's ms in STAGE_NAMES' order).
    slowest: list[tuple[float, list[float]]] = field(default_factory=list)


def e2e(
    url: str,
    echoes: Echoes,
    seconds: float,
    base: int,
    progress: Callable[[], int] | None = None,
    *,
    rate: float = E2E_RATE,
    chats: int = CHATS,
    first_chat: int = 100_000,
) -> Latency:
    echoes.poll()  # start after every earlier reply
    sent, outcomes = asyncio.run(_steady(url, rate, seconds, base, chats, first_chat))
    latencies: dict[str, float] = {}

    def match(calls: list[dict[str, Any]]) -> None:
        for call in calls:
            found = _E2E_TOKEN.search(str(call["params"].get("text", "")))
            if found and found.group(0) in sent:
                latencies.setdefault(found.group(0), call["at"] - sent[found.group(0)])

    expected = echoes.count + outcomes.get("200", 0)
    echoes.wait_for(expected, on_calls=match, progress=progress)
    values = sorted(latencies.values())
    times = {token: (sent[token], sent[token] + latency) for token, latency in latencies.items()}
    if len(values) < 2:
        return Latency(float("nan"), float("nan"), len(sent), len(values), dict(outcomes), times)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return Latency(cuts[49] * 1000, cuts[98] * 1000, len(sent), len(values), dict(outcomes), times)


# Where an echo's time goes, from its rows' timestamps (each taken in Python just before the
# row's statement) between the client's send and the sandbox's receipt.
_STAGES_SQL = """
SELECT substring(u.payload->'message'->>'text' from 'e2e-[0-9]+-[0-9]+'),
       extract(epoch from u.received_at),
       extract(epoch from (SELECT min(r.created_at) FROM bots_consumerrun r WHERE r.update_id = u.id)),
       extract(epoch from m.created_at),
       extract(epoch from (SELECT min(a.started_at) FROM outbox_attempt a WHERE a.message_id = m.id)),
       extract(epoch from m.sent_at)
FROM bots_inboundupdate u JOIN outbox_outboundmessage m ON m.source_update_id = u.id
WHERE u.payload->'message'->>'text' LIKE 'e2e-%'
"""
STAGE_NAMES = (
    "client → update row",
    "update row → runs written (wake-up, hop, routing)",
    "runs written → reply row (the consumers)",
    "reply row → attempt row (claim, slots)",
    "attempt row → sandbox has it",
    "sandbox has it → sent mark",
)


def dovecote_stages(db: str, latency: Latency) -> list[tuple[str, float]]:
    """The median of each stage, in ms, over the echoes the e2e run matched (and, in
    `latency.slowest`, the stages of its three slowest echoes)."""
    spans: list[list[float]] = [[] for _ in STAGE_NAMES]
    echoes: list[tuple[float, list[float]]] = []
    for line in psql_db(db, _STAGES_SQL).splitlines():
        token, *marks = line.split("|")
        if token not in latency.times or "" in marks:
            continue
        sent, received = latency.times[token]
        update, runs, reply, attempt, sent_mark = (float(m) for m in marks)
        points = [sent, update, runs, reply, attempt, received, sent_mark]
        stages = [(points[n + 1] - points[n]) * 1000 for n in range(len(STAGE_NAMES))]
        for n, ms in enumerate(stages):
            spans[n].append(ms)
        echoes.append(((received - sent) * 1000, stages))
    latency.slowest = sorted(echoes, reverse=True)[:3]
    return [(name, statistics.median(values)) for name, values in zip(STAGE_NAMES, spans, strict=True) if values]


# -------------------------------------------------------------------------- processes
@dataclass
class Cleanup:
    """Everything this run started or created, undone in reverse in `close` (by PID and
    process group, never by name)."""

    procs: list[c.Proc] = field(default_factory=list)
    databases: list[str] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    keep_logs: bool = False
    failed: bool = False

    def start(self, name: str, args: list[str], env: dict[str, str]) -> c.Proc:
        """A process in its own group, its output in /tmp/dovecote-<run>-<name>-*.log."""
        proc = c.Proc(f"{RUN}-{name}", args, env)
        self.procs.append(proc)
        self.logs.append(proc.log_path)
        return proc

    def stop(self, proc: c.Proc) -> None:
        proc.stop(20)
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(20)
        self.procs.clear()
        for db in reversed(self.databases):
            c.drop_database(db)
        self.databases.clear()
        for log in self.logs:
            if self.failed or self.keep_logs:
                print(f"kept log {log}")
            else:
                log.unlink(missing_ok=True)


def psql_db(db: str, sql: str) -> str:
    cmd = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", db, "-tAqc", sql]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def create_database(cleanup: Cleanup, db: str, template: str | None = None) -> None:
    c.psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    cleanup.databases.append(db)
    c.psql(f"CREATE DATABASE {db}" + (f" TEMPLATE {template}" if template else ""))


def wait_http(proc: c.Proc, probe: Callable[[], bool], what: str, timeout: float = 60) -> None:
    def up() -> bool:
        if not proc.alive():
            raise SystemExit(f"{what} died on start:\n{proc.log()[-3000:]}")
        try:
            return probe()
        except httpx.HTTPError:
            return False

    c.wait_until(up, timeout, what, interval=0.2)


def start_sandbox(cleanup: Cleanup) -> str:
    port = c.free_port()
    args = [str(c.BIN / "python"), "-m", "bots.sandbox.server", "--port", str(port)]
    proc = cleanup.start("sandbox", args, c.bench_env(f"{RUN}_sandbox"))
    url = f"http://127.0.0.1:{port}"
    wait_http(proc, lambda: httpx.get(f"{url}/sandbox/health", timeout=1).status_code == 200, "the sandbox")
    return url


def process_cpu(pid: int) -> float | None:
    """utime + stime of one process so far, in seconds (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_pid() -> int:
    import redis

    return int(redis.Redis.from_url(REDIS_URL).info("server")["process_id"])


def cpu(groups: dict[str, int], db: str | None) -> dict[str, float]:
    """CPU seconds so far of each named process tree, of the redis-server on 127.0.0.1:6379, and
    (as "pg:<pid>") of each PostgreSQL backend connected to the system's database `db`."""
    snapshot = c.cpu_snapshot(groups)
    # Not machine-wide sums: other test runs start and stop PostgreSQL backends and Redis
    # servers of their own, and a process gone between two snapshots makes a sum go down.
    del snapshot["postgres"], snapshot["redis"]
    redis_cpu = process_cpu(redis_pid())
    if redis_cpu is not None:
        snapshot["redis"] = redis_cpu
    for name, pid in groups.items():  # the tree's main process alone (gunicorn's, Celery's)
        seconds = process_cpu(pid)
        if seconds is not None:
            snapshot[f"main:{name}"] = seconds
    if db is not None:
        sql = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        for pid in map(int, psql_db(db, sql).split()):
            seconds = process_cpu(pid)
            if seconds is not None:
                snapshot[f"pg:{pid}"] = seconds
    return snapshot


@dataclass
class Row:
    system: str
    rate: float | None = None
    cpu_ms: float | None = None
    pg_ms: float | None = None  # the system database's PostgreSQL backends, per update
    redis_ms: float | None = None  # the redis-server (shared), per update
    latency: Latency | None = None
    notes: list[str] = field(default_factory=list)


def throughput(
    row: Row,
    loader: Loader,
    url: str,
    seconds: float,
    groups: dict[str, int],
    db: str | None = None,
    echoes: Echoes | None = None,
    stored: Callable[[], int] | None = None,
    progress: Callable[[], int] | None = None,
) -> None:
    """Warm up, then measure one load run: req/s, and CPU per update handled: per update
    stored (`stored` counts the rows) or, with `echoes`, per update echoed, waiting until the
    sandbox has had a reply to every update (every row stored, when `stored` is given too).
    The requests in flight when the load generator stops are handled but not counted by it:
    the rows and echoes are."""
    if echoes is not None:
        echoes.poll()
    baseline = echoes.count if echoes is not None else 0
    rows_start = stored() if stored is not None else 0
    warm = loader.run(url, WARMUP_SECONDS)
    if echoes is not None:
        time.sleep(0.3)  # the requests in flight at the end
        target = stored() - rows_start if stored is not None else warm.ok
        if not echoes.settle(baseline + target, progress):
            row.notes.append(f"warm-up: only {echoes.count - baseline} of {target} updates echoed")
    time.sleep(0.5)
    if db is not None and ANALYZE_AFTER_WARMUP:
        # A deployed bot's tables have statistics (autovacuum analyzes a table once a tenth
        # of it has changed, looking every minute). This database was created seconds ago and
        # grows from empty within the run: the plans prepared at its first updates, kept for
        # each connection's life, would be those for empty tables (sequential scans of the
        # outbox in every batch of replies). ANALYZE also drops those plans.
        psql_db(db, "ANALYZE")
    rows_before = stored() if stored is not None else 0
    before = cpu(groups, db)
    echoes_before = echoes.count if echoes is not None else 0
    started = time.time()
    load = loader.run(url, seconds)
    row.rate = load.rate
    if load.errors:
        row.notes.append(f"refused or failed: {load.errors} of {load.requests} requests")
    time.sleep(0.5)
    if echoes is not None:
        target = stored() - rows_before if stored is not None else load.ok
        complete = echoes.settle(echoes_before + target, progress)
        handled = echoes.count - echoes_before
        if not complete:
            row.notes.append(f"only {handled} of {target} updates echoed: gave up after {STALL_SECONDS:g} s stalled")
        drained = echoes.last_at - started
        row.notes.append(
            f"{handled} updates echoed ({load.ok} answered 200 within the run); the last echo came "
            f"{drained:.1f} s after the load began: {handled / drained:.0f} echoes/s"
        )
    else:
        handled = stored() - rows_before if stored is not None else load.ok
        row.notes.append(f"{handled} updates stored ({load.ok} answered 200 within the run)")
    after = cpu(groups, db)
    used = c.cpu_used(before, after)
    own = sum(used[name] for name in groups)
    # A backend that connected during the run counts whole; one that left is lost.
    postgres = sum(seconds for name, seconds in used.items() if name.startswith("pg:"))
    if handled:
        row.cpu_ms = own / handled * 1000
        row.pg_ms = postgres / handled * 1000 if db is not None else None
        row.redis_ms = used.get("redis", 0.0) / handled * 1000
    row.notes.append(
        "CPU s: "
        + ", ".join(f"{name} {used[name]:.2f} (main process {used.get('main:' + name, 0.0):.2f})" for name in groups)
        + (f"; PostgreSQL backends of its database {postgres:.2f}" if db is not None else "")
        + f"; redis-server {used.get('redis', 0.0):.2f} (shared)"
    )


# ----------------------------------------------------------------------------- systems
def run_bare(cleanup: Cleanup, loader: Loader, seconds: float) -> Row:
    row = Row("bare Django view (gunicorn 2 x 4, persistent connections)")
    db = f"{RUN}_bare"
    create_database(cleanup, db)
    psql_db(db, BARE_TABLE_SQL)
    port = c.free_port()
    env = {
        **os.environ,
        "BARE_DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{db}",
        "BIND": f"127.0.0.1:{port}",
        "PYTHONUNBUFFERED": "1",
    }
    args = [str(c.BIN / "gunicorn"), "-c", "bench/peers/bare_gunicorn.conf.py", "bench.peers.bare_view:application"]
    web = cleanup.start("bare-web", args, env)
    base = f"http://127.0.0.1:{port}"
    wait_http(web, lambda: httpx.get(f"{base}/", timeout=1).status_code == 200, "the bare view")
    throughput(
        row,
        loader,
        f"{base}/webhook",
        seconds,
        {"gunicorn": web.pid},
        db,
        stored=lambda: int(psql_db(db, "SELECT count(*) FROM bare_update")),
    )
    cleanup.stop(web)
    return row


def run_ptb(cleanup: Cleanup, loader: Loader, sandbox: str, seconds: float, e2e_seconds: float) -> Row:
    row = Row("python-telegram-bot run_webhook echo (in memory)")
    sandbox_reset(sandbox)
    port = c.free_port()
    args = [str(c.BIN / "python"), "bench/peers/ptb_echo.py", "--port", str(port), "--api-base-url", sandbox]
    args += ["--token", PTB_TOKEN, "--secret", SECRET]
    ptb = cleanup.start("ptb-echo", args, {**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}/ptb-echo"
    probe = json.dumps(update_body(1, 1, chat_for(1), "probe")).encode()
    wait_http(ptb, lambda: httpx.post(url, content=probe, headers=HEADERS, timeout=2).status_code == 200, "PTB")
    echoes = Echoes(sandbox, PTB_TOKEN)
    echoes.wait_for(1)
    throughput(row, loader, url, seconds, {"ptb": ptb.pid}, echoes=echoes)
    row.latency = e2e(url, echoes, e2e_seconds, 5 * ID_BLOCK)
    cleanup.stop(ptb)
    return row


def dovecote_env(db: str, sandbox: str, **overrides: str) -> dict[str, str]:
    return c.bench_env(
        db,
        DEBUG="0",
        SECRET_KEY=f"sidebyside-{RUN}-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz",
        ALLOWED_HOSTS="127.0.0.1,localhost",
        REDIS_URL=REDIS_URL,
        CELERY_BROKER_URL=REDIS_URL,
        TELEGRAM_API_BASE_URL=sandbox,
        LOG_LEVEL="WARNING",
        CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT="1",
        **overrides,
    )


def dovecote_progress(db: str) -> Callable[[], int]:
    """Dovecote's work done so far (consumer runs finished, messages sent): while it moves,
    the bench waits for replies however long they take (a reply's drain task queues behind
    every consumer run published before it)."""
    sql = (
        "SELECT (SELECT count(*) FROM bots_consumerrun WHERE state = 'done')"
        " + (SELECT count(*) FROM outbox_outboundmessage WHERE state = 'sent')"
    )
    return lambda: int(psql_db(db, sql))


def start_dovecote_web(cleanup: Cleanup, env: dict[str, str], name: str) -> tuple[c.Proc, str]:
    port = c.free_port()
    # As the Procfile runs it: gunicorn reads gunicorn.conf.py (2 x 4 threads, access log).
    web = cleanup.start(name, [str(c.BIN / "gunicorn"), "project.wsgi"], {**env, "BIND": f"127.0.0.1:{port}"})
    base = f"http://127.0.0.1:{port}"
    wait_http(web, lambda: httpx.get(f"{base}/healthz", timeout=1).status_code == 200, "Dovecote's web")
    return web, f"{base}/webhooks/telegram/dovecote/"


def start_dovecote_worker(cleanup: Cleanup, env: dict[str, str]) -> c.Proc:
    """`celery -A project worker -c 2` (prefork) on the Procfile's queues, at log level
    warning, as bench/_common.py starts the other benches' workers."""
    prefix = env["DOVECOTE_QUEUE_PREFIX"]
    args = [str(c.BIN / "celery"), "-A", "project", "worker", "-l", "warning", "-P", "prefork", "-c", "2"]
    args += ["-Q", f"{prefix}dovecote,{prefix}dovecote.bulk", "-n", f"{RUN}@%h"]
    args += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    return cleanup.start("dovecote-worker", args, env)


def run_dovecote(
    cleanup: Cleanup, loader: Loader, sandbox: str, seconds: float, e2e_seconds: float
) -> tuple[Row, Row, Row]:
    alone = Row("Dovecote webhook alone (worker stopped)")
    whole = Row("Dovecote whole system (web + worker -c 2)")
    paid = Row(f"Dovecote, a {PAID_RATE_LIMIT}/s bot at {PAID_E2E_RATE} updates/s over {PAID_CHATS} chats")
    sandbox_reset(sandbox)
    template = f"{RUN}_dc_template"
    env = dovecote_env(template, sandbox)
    c.setup_database(template, env)
    cleanup.databases.append(template)
    add_bot = [str(c.BIN / "python"), "manage.py", "add_bot", "dovecote", "--token", DOVECOTE_TOKEN]
    add_bot += ["--webhook-secret", SECRET, "--api-base-url", sandbox, "--responder", "echo"]
    subprocess.run(add_bot, cwd=c.ROOT, env=env, check=True, capture_output=True)

    # 1. The webhook alone: updates stored, nobody routes them.
    db = f"{RUN}_dc_alone"
    create_database(cleanup, db, template)
    env = dovecote_env(db, sandbox)
    web, url = start_dovecote_web(cleanup, env, "dovecote-web-alone")
    throughput(
        alone,
        loader,
        url,
        seconds,
        {"web": web.pid},
        db,
        stored=lambda: int(psql_db(db, "SELECT count(*) FROM bots_inboundupdate")),
    )
    cleanup.stop(web)
    c.drop_database(db)
    cleanup.databases.remove(db)

    # 2. The whole system, rate limiter off: every update stored, routed, answered.
    db = f"{RUN}_dc_whole"
    create_database(cleanup, db, template)
    env = dovecote_env(db, sandbox, DOVECOTE_RATE_LIMITS_ENABLED="0")
    web, url = start_dovecote_web(cleanup, env, "dovecote-web-whole")
    worker = start_dovecote_worker(cleanup, env)
    echoes = Echoes(sandbox, DOVECOTE_TOKEN)
    groups = {"web": web.pid, "worker": worker.pid}
    throughput(
        whole,
        loader,
        url,
        seconds,
        groups,
        db,
        echoes=echoes,
        stored=lambda: int(psql_db(db, "SELECT count(*) FROM bots_inboundupdate")),
        progress=dovecote_progress(db),
    )
    counts = psql_db(db, "SELECT state || ' ' || count(*) FROM outbox_outboundmessage GROUP BY state ORDER BY 1")
    whole.notes.append("outbox: " + ", ".join(counts.splitlines()))
    cleanup.stop(worker)
    cleanup.stop(web)
    c.drop_database(db)
    cleanup.databases.remove(db)

    # 3. End to end at a steady 20 updates/s, rate limiter on (the production default).
    sandbox_reset(sandbox)
    db = f"{RUN}_dc_e2e"
    create_database(cleanup, db, template)
    env = dovecote_env(db, sandbox)
    web, url = start_dovecote_web(cleanup, env, "dovecote-web-e2e")
    worker = start_dovecote_worker(cleanup, env)
    echoes = Echoes(sandbox, DOVECOTE_TOKEN)
    e2e(url, echoes, 2, 6 * ID_BLOCK, dovecote_progress(db))  # warm-up: the worker's connections
    whole.latency = e2e(url, echoes, e2e_seconds, 7 * ID_BLOCK, dovecote_progress(db))
    whole.latency.stages = dovecote_stages(db, whole.latency)
    whole.notes.append("e2e with the rate limiter on (production default)")

    # 4. A paid-broadcast bot (1,000 messages/s) at 100 updates/s over 1,500 chats.
    set_rate = [str(c.BIN / "python"), "manage.py", "add_bot", "dovecote", "--token", DOVECOTE_TOKEN]
    set_rate += ["--rate-limit", str(PAID_RATE_LIMIT)]
    subprocess.run(set_rate, cwd=c.ROOT, env=env, check=True, capture_output=True)
    paid.latency = e2e(
        url,
        echoes,
        e2e_seconds,
        8 * ID_BLOCK,
        dovecote_progress(db),
        rate=PAID_E2E_RATE,
        chats=PAID_CHATS,
        # Chats the earlier phase did not use: a chat's one message a second would hold a
        # reply back for Telegram's limit, not for the system's speed.
        first_chat=200_000,
    )
    paid.latency.stages = dovecote_stages(db, paid.latency)
    paid.notes.append(f"bot rate limit {PAID_RATE_LIMIT}/s, {PAID_CHATS} chats, rate limiter on")
    cleanup.stop(worker)
    cleanup.stop(web)
    return alone, whole, paid


# ------------------------------------------------------------------------------ report
def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def report(rows: dict[str, Row], loader: Loader, seconds: float, e2e_seconds: float) -> None:
    size = len(json.dumps(update_body(ID_BLOCK + 10**10 + 1, 1, chat_for(1), update_text(ID_BLOCK + 10**10 + 1))))
    print()
    print(
        f"load: {loader.describe()}, {seconds:g} s after {WARMUP_SECONDS} s warm-up; {size}-byte message updates "
        f"over {CHATS} chats, unique update_ids; e2e: {E2E_RATE} updates/s for {e2e_seconds:g} s; "
        + ("databases analyzed after the warm-up" if ANALYZE_AFTER_WARMUP else "databases not analyzed (--no-analyze)")
    )
    print()
    print(f"| system | webhook req/s | CPU per update (ms) | e2e p50 / p99 at {E2E_RATE} updates/s |")
    print("|---|---|---|---|")
    for row in rows.values():
        latency = "—"
        if row.latency is not None:
            latency = f"{row.latency.p50_ms:.1f} / {row.latency.p99_ms:.1f} ms"
            if row.latency.answered < row.latency.sent:
                latency += f" ({row.latency.answered}/{row.latency.sent} answered)"
        print(f"| {row.system} | {fmt(row.rate, '.0f')} | {fmt(row.cpu_ms, '.2f')} | {latency} |")
    print()
    print("CPU per update: the system's own processes; per stored update for the bare view and the webhook")
    print("alone, per echoed update for PTB and the whole of Dovecote. Not counted in it, per update:")
    print("the PostgreSQL backends serving the system's database, and redis-server (shared with other users):")
    for key, row in rows.items():
        print(f"  {key:15} PostgreSQL {fmt(row.pg_ms, '.2f')} ms, Redis {fmt(row.redis_ms, '.2f')} ms")
    print()
    for key, row in rows.items():
        for note in row.notes:
            print(f"  {key}: {note}")
        if row.latency is not None:
            print(
                f"  {key}: e2e sent {row.latency.sent}, webhook answers {row.latency.outcomes}, "
                f"echoes matched {row.latency.answered}"
            )
            for name, ms in row.latency.stages:
                print(f"  {key}: e2e p50 {ms:6.2f} ms  {name}")
            for total, stages in row.latency.slowest:
                print(f"  {key}: a slow echo, {total:.1f} ms: " + " / ".join(f"{ms:.1f}" for ms in stages))
    print()
    for name, value, op, target in target_checks(rows):
        print(f"{name:42} {value:8.2f}   target {op} {target:g}: {verdict(value, op, target)}")


def report_rounds(rounds: list[dict[str, Row]]) -> None:
    """Each target's figure in every round and their median: the rounds' spread is the
    host's noise, which one round's ratio of two runs minutes apart cannot show."""
    by_name: dict[str, list[float]] = {}
    targets: dict[str, tuple[str, float]] = {}
    for rows in rounds:
        for name, value, op, target in target_checks(rows):
            by_name.setdefault(name, []).append(value)
            targets[name] = (op, target)
    print(f"\n=== {len(rounds)} rounds: each round's figure, then their median")
    for name, values in by_name.items():
        op, target = targets[name]
        median = statistics.median(values)
        each = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:42} {each}  median {median:.2f}   target {op} {target:g}: {verdict(median, op, target)}")


def verdict(value: float, op: str, target: float) -> str:
    return "met" if (value >= target if op == ">=" else value <= target) else "NOT MET"


def target_checks(rows: dict[str, Row]) -> list[tuple[str, float, str, float]]:
    """(what, figure, ">=" or "<=", the issue's target) for the rows this run measured."""
    found: list[tuple[str, float, str, float]] = []
    bare, ptb = rows.get("bare"), rows.get("ptb")
    alone, whole = rows.get("dovecote-alone"), rows.get("dovecote-whole")
    if alone and bare and alone.rate and bare.rate:
        found.append(("webhook alone / bare view req/s", alone.rate / bare.rate, ">=", 0.8))
    if whole and ptb and whole.rate and ptb.rate:
        found.append(("whole system / PTB req/s", whole.rate / ptb.rate, ">=", 0.5))
    if whole and whole.cpu_ms is not None:
        found.append(("whole system CPU per echoed update, ms", whole.cpu_ms, "<=", 1.5))
    if whole and whole.latency is not None:
        found.append(("e2e p50, ms", whole.latency.p50_ms, "<=", 10.0))
        found.append(("e2e p99, ms", whole.latency.p99_ms, "<=", 30.0))
    paid = rows.get("dovecote-paid")
    if paid and paid.latency is not None:
        found.append((f"e2e p99 at {PAID_E2E_RATE}/s, {PAID_RATE_LIMIT}/s bot, ms", paid.latency.p99_ms, "<=", 100.0))
    return found


# -------------------------------------------------------------------------------- main
SYSTEMS = ("bare", "ptb", "dovecote")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10, help="length of each measured load run")
    parser.add_argument("--e2e-seconds", type=float, default=15, help="length of the steady 20 updates/s run")
    parser.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated subset of: " + ",".join(SYSTEMS))
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' log files (paths printed)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the whole sequence this many times; print each round and the medians"
    )
    parser.add_argument(
        "--no-analyze",
        action="store_true",
        help="do not ANALYZE a system's database after the warm-up (its statistics then say empty tables)",
    )
    args = parser.parse_args()
    global ANALYZE_AFTER_WARMUP
    ANALYZE_AFTER_WARMUP = not args.no_analyze
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SYSTEMS)
    if unknown:
        parser.error(f"--only: unknown system(s) {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    if "ptb" in only and importlib.util.find_spec("tornado") is None:
        raise SystemExit("PTB's webhook needs tornado: make .venv/.installed-dev (tornado is in requirements-dev.txt)")

    if args.rounds < 1:
        parser.error("--rounds: at least 1")

    loader = Loader()
    if not loader.wrk:
        print(f"load generator: {loader.describe()}")
    cleanup = Cleanup(keep_logs=args.keep_logs)
    rounds: list[dict[str, Row]] = []
    try:
        sandbox = start_sandbox(cleanup)
        for n in range(args.rounds):
            rows: dict[str, Row] = {}
            rounds.append(rows)
            for system in only:
                print(
                    f"[{time.strftime('%H:%M:%S')}] {'' if args.rounds == 1 else f'round {n + 1}: '}{system} ... "
                    f"(load average {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
                if system == "bare":
                    rows["bare"] = run_bare(cleanup, loader, args.seconds)
                elif system == "ptb":
                    rows["ptb"] = run_ptb(cleanup, loader, sandbox, args.seconds, args.e2e_seconds)
                else:
                    rows["dovecote-alone"], rows["dovecote-whole"], rows["dovecote-paid"] = run_dovecote(
                        cleanup, loader, sandbox, args.seconds, args.e2e_seconds
                    )
    except KeyboardInterrupt:
        raise
    except BaseException:
        cleanup.failed = True  # keep the logs
        raise
    finally:
        # A second Ctrl-C must not cut the clean-up short.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            cleanup.close()
        finally:
            signal.signal(signal.SIGINT, previous)
    print(f"[{time.strftime('%H:%M:%S')}] done (load average {os.getloadavg()[0]:.2f})", flush=True)
    for n, rows in enumerate(rounds):
        if len(rounds) > 1:
            print(f"\n=== round {n + 1} of {len(rounds)}")
        report(rows, loader, args.seconds, args.e2e_seconds)
    if len(rounds) > 1:
        report_rounds(rounds)


if __name__ == "__main__":
    main()
