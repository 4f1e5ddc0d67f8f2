"""`make demo` as a newcomer runs it: a fresh clone, no DATABASE_URL or REDIS_URL, nothing but
the installed requirements. Its own PostgreSQL and Redis start, the bot answers in the sandbox,
the admin answers, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bots.sandbox.client import SandboxClient
from reconciliation.management.commands.demo_setup import DEMO_TOKEN
from tests.support import ROOT, VENV_BIN, free_port, wait_until

pytestmark = pytest.mark.e2e


def processes_in(directory: Path) -> list[str]:
    """Every process working in `directory` or naming it on its command line: the demo's web,
    worker, beat and sandbox, and its PostgreSQL and Redis (each runs in its data folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if cwd.startswith(str(directory)) or str(directory) in cmdline:
            found.append(f"{entry.name} {cmdline.strip()}")
    return found


@pytest.fixture
def clone(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "dovecote"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(target)], check=True, timeout=60)
    yield target
    for line in processes_in(target):  # only when the test failed before the demo stopped
        os.kill(int(line.split()[0]), signal.SIGKILL)


def run_demo(clone: Path, log_path: Path) -> str:
    """`make demo`'s script until its scenario has told its story, then Ctrl-C; its output."""
    web, sandbox = free_port(), free_port()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "DEMO_WEB_PORT": str(web),
        "DEMO_SANDBOX_PORT": str(sandbox),
    }
    with log_path.open("wb") as log:
        # The script behind `make demo` (make would install the requirements first), in a
        # session of its own so that the test can press Ctrl-C as a terminal does: SIGINT to
        # the whole foreground group.
        demo = subprocess.Popen(
            [str(VENV_BIN / "python"), "scripts/demo.py"],
            cwd=clone,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        client = SandboxClient(f"http://127.0.0.1:{sandbox}", timeout=5)

        def told() -> bool:
            return "Ctrl-C stops everything." in log_path.read_text() or demo.poll() is not None

        wait_until(told, timeout=240, interval=0.5, message="the demo's scenario to finish")
        assert demo.poll() is None, log_path.read_text()
        assert any(text.startswith("Echo:") for text in client.sent_texts(token=DEMO_TOKEN))
        admin = httpx.get(f"http://127.0.0.1:{web}/admin/", timeout=10)
        assert admin.status_code in (200, 302)
        assert (clone / "var" / "postgres" / "PG_VERSION").exists()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGINT)
        demo.wait(60)
    return log_path.read_text()


def test_the_demo_runs_on_its_own_postgresql_and_redis_and_stops_cleanly(clone: Path) -> None:
    output = run_demo(clone, clone.parent / "demo.log")

    assert "replies Carol received: 1" in output  # the duplicate webhook answered once
    assert "delivered: 5 (one per chat" in output  # the 429 storm ridden out
    assert "demo: postgres started" in output
    assert "demo: redis-server started" in output
    assert "demo: redis-server stopped" in output
    assert "demo: postgres stopped" in output
    assert processes_in(clone) == []

    # Started again on the data it kept (as the README's walkthrough does), the demo tells its
    # story again: a new sandbox continues the bot's update ids, none is dropped as a duplicate.
    again = run_demo(clone, clone.parent / "demo-again.log")
    assert "creating the PostgreSQL cluster" not in again
    assert "replies Carol received: 1" in again
    assert "delivered: 5 (one per chat" in again
    assert processes_in(clone) == []
