"""A PostgreSQL cluster of a test's own, which the test may crash.

`initdb` into a temporary directory, `pg_ctl` on a free port, fsync on: the shared server on
5432 is never stopped or crashed (other runs use it). Two crashes, as a server dies:

- `crash()`: `pg_ctl stop -m immediate`. Every process exits at once, without a checkpoint
  and without writing the WAL still in shared memory; the next start replays the WAL files.
- `kill_postmaster()`: SIGKILL of the postmaster. Its backends, orphaned, exit when they
  notice (each at its next wait); only once they are gone can a new postmaster attach the
  data directory again.

Either way what a commit that did not wait for the disk (`synchronous_commit` off) had left
in WAL buffers is lost, which is what the crash tests are for. A process crash does not lose
what was written to the kernel: only a machine's crash does.

`django_connection_at()` points this (the test's) process's Django connection at one of its
databases for a while, and back.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from tests.support import ROOT, VENV_BIN, base_env, free_port, require_tool, wait_until

# Smaller than a server's defaults: several clusters may run beside the shared one on 2 cores.
# wal_writer_delay: how long an asynchronous commit may sit in WAL buffers (PostgreSQL's
# default is 200 ms); a test widens it so that a crash surely finds some there.
DEFAULT_SETTINGS = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "max_connections": "100",
    "shared_buffers": "32MB",
    "wal_writer_delay": "200ms",
    # After a crash, one syncfs() of the file system instead of an fsync() of every file of
    # every database before recovery (4-6 s here, 1 s with it): the same durability.
    "recovery_init_sync_method": "syncfs",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] '",
}


PREFIX = "dovecote-pg-"
# WAL inserted but not yet written (pg_current_wal_lsn is the write position).
UNWRITTEN_WAL = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), pg_current_wal_lsn())"


def bindir() -> Path | None:
    """PostgreSQL's server programs: DOVECOTE_PG_BIN, else the installed server's."""
    if os.environ.get("DOVECOTE_PG_BIN"):
        return Path(os.environ["DOVECOTE_PG_BIN"])
    config = shutil.which("pg_config")
    found = subprocess.run([config, "--bindir"], capture_output=True, text=True, check=False).stdout if config else ""
    if found.strip() and (Path(found.strip()) / "initdb").exists():
        return Path(found.strip())
    # Debian's /usr/bin/pg_config may belong to the client package only.
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    return versions[-1].parent if versions else None


class PrivatePostgres:
    """A cluster in a temporary directory; as root, its programs run as the `postgres` user
    (initdb refuses root)."""

    def __init__(self, *, settings: dict[str, str] | None = None) -> None:
        install = "`make services` installs Debian's postgresql (or set DOVECOTE_PG_BIN)"
        self.bin = require_tool("PostgreSQL's initdb", bindir(), install=install)
        self.port = free_port()
        # The pid in the name: a run killed before its teardown leaves a cluster running, which
        # the next run stops (`remove_clusters_of_dead_runs`).
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self.data = self.dir / "data"
        self.log_path = self.dir / "server.log"
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self._user: dict[str, Any] = {}
        self._orphans: list[int] = []  # a killed postmaster and its processes, until gone
        if os.geteuid() == 0:
            owner = require_tool("a postgres user (initdb refuses root)", _user("postgres"), install=install)
            self._user = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)

    # ------------------------------------------------------------------ the server
    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.dir,
            **self._user,
        )
        if done.returncode != 0:
            output = f"{done.stdout}{done.stderr}"
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{output}\n{self.log()}")
        return done

    def init(self) -> PrivatePostgres:
        # -N: initdb's own files need not reach the disk; the server's writes do (fsync on).
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "-N")
        lines = [f"{k} = {v}" for k, v in self.settings.items()]
        lines += ["listen_addresses = '127.0.0.1'", f"port = {self.port}", f"unix_socket_directories = '{self.dir}'"]
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("\n# tests/private_postgres.py\n" + "\n".join(lines) + "\n")
        return self

    def start(self) -> None:
        """Start the server and wait until it takes connections (crash recovery included);
        after `kill_postmaster`, once its processes are gone."""
        if self._orphans:
            orphans, self._orphans = self._orphans, []
            wait_until(
                lambda: not any(_exists(p) for p in orphans),
                timeout=60,
                interval=0.05,
                message=f"the killed postmaster's processes {orphans} to exit",
            )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", "60", "start")

    def crash(self) -> None:
        """An immediate stop: no checkpoint, WAL buffers lost; the next start recovers."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (FileNotFoundError, ValueError):
            return None

    def kill_postmaster(self) -> None:
        """SIGKILL the postmaster. Its backends, orphaned, go on until they notice; `start`
        waits until they and it are gone (reaped, not zombies: a new postmaster refuses a
        data directory whose last postmaster still shows)."""
        pid = self.postmaster_pid()
        if pid is None:
            raise RuntimeError("no postmaster running")
        self._orphans = [pid, *_children(pid)]
        os.kill(pid, signal.SIGKILL)

    def running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and _exists(pid)

    def stop(self) -> None:
        """Stop it (fast) and remove its directory."""
        if self.running():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    # ---------------------------------------------------------------- databases
    def url(self, dbname: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, autocommit=True)

    def create_database(self, name: str, *, template: str | None = None) -> None:
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))

    def drop_database(self, name: str) -> None:
        with self.connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def migrate(self, dbname: str) -> None:
        """Django's migrations, in a process of their own, into `dbname`."""
        env = base_env(DATABASE_URL=self.url(dbname))
        done = subprocess.run(
            [str(VENV_BIN / "python"), "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"migrate into {dbname} failed:\n{done.stdout}{done.stderr}")

    def unwritten_wal(self, conn: psycopg.Connection[Any] | None = None) -> int:
        """Bytes of WAL in shared memory only, not yet written to the kernel: what a crash of
        PostgreSQL now would lose."""
        if conn is None:
            with self.connect() as own:
                return self.unwritten_wal(own)
        row = conn.execute(UNWRITTEN_WAL).fetchone()
        return int(row[0]) if row else 0

    def crash_when_wal_waits(self, *, kill: bool = False, within: float = 1.0) -> tuple[int, float]:
        """Crash the server (`crash`, or `kill_postmaster` with `kill`) at the first moment,
        within `within` seconds, that some of its WAL is in shared memory only, not yet
        written to the kernel: what a crash then loses (asynchronous commits among them;
        a synchronous commit's own WAL is written before it answers). Returns those bytes as
        last seen (0 when none showed in time: it crashes all the same) and when (time.time())
        the crash was ordered."""
        deadline = time.monotonic() + within
        with self.connect() as watch:
            while True:
                unwritten = self.unwritten_wal(watch)
                if unwritten > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            ordered = time.time()
            if kill:
                self.kill_postmaster()
            else:
                self.crash()
        return unwritten, ordered


@contextmanager
def django_connection_at(server: PrivatePostgres, dbname: str) -> Iterator[None]:
    """This process's default Django connection on `dbname` of `server`, then back where it
    was (pytest-django's teardown flushes the test database through it)."""
    from django.db import connections

    conn = connections["default"]
    saved = dict(conn.settings_dict)
    conn.close()
    conn.settings_dict.update(HOST="127.0.0.1", PORT=str(server.port), NAME=dbname, USER="postgres", PASSWORD="")
    try:
        yield
    finally:
        conn.close()
        conn.settings_dict.clear()
        conn.settings_dict.update(saved)


def remove_clusters_of_dead_runs() -> None:
    """Stop (immediately) and remove the clusters that test runs no longer alive left behind
    (killed before their teardown): each one's directory is named after its run's pid."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        run = folder.name.removeprefix(PREFIX).split("-", 1)[0]
        if not run.isdigit() or _exists(int(run)):
            continue
        try:
            postmaster = int((folder / "data" / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            postmaster = None
        if postmaster is not None and _exists(postmaster):
            os.kill(postmaster, signal.SIGQUIT)  # PostgreSQL's immediate shutdown
            wait_until(lambda pid=postmaster: not _exists(pid), timeout=30, message=f"postmaster {postmaster} to stop")
        shutil.rmtree(folder, ignore_errors=True)


def _user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The fields after the command's closing parenthesis: state, then the parent's pid.
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _exists(pid: int) -> bool:
    """The process is there, zombies included (they still hold the postmaster's pid)."""
    return Path(f"/proc/{pid}").exists()
