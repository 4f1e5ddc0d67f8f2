"""The README's sandbox walkthrough, run as a newcomer types it: its own commands, line by
line (the ports swapped for free ones), against real processes - the sandbox, honcho's web,
worker and beat - until the sandbox has the bot's answer."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess

import httpx
import pytest

from tests.support import ROOT, VENV_BIN, Process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def walkthrough() -> list[str]:
    """The commands of the README's sandbox block, a continued line joined to its first."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    [block] = [b for b in blocks if "/sandbox/updates" in b and "set_webhook" in b]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("  #", 1)[0].strip()
        if line:
            commands.append(line)
    return commands


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_the_readmes_sandbox_walkthrough_gets_the_bot_to_answer(process_env, processes: list[Process]) -> None:
    web_port, sandbox_port = free_ports(2)
    env = {
        **process_env,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "WORKER_CONCURRENCY": "1",
    }
    env.pop("TELEGRAM_API_BASE_URL")  # the walkthrough names the sandbox itself
    commands = [c.replace("8000", str(web_port)).replace("8081", str(sandbox_port)) for c in walkthrough()]
    assert any(c.startswith("python manage.py set_webhook") for c in commands), commands

    outputs = []
    for command in commands:
        if command.startswith("export "):
            env.update(dict(part.split("=", 1) for part in shlex.split(command)[1:]))
        elif command.endswith("&"):
            proc = Process("walkthrough", ["bash", "-c", command.rstrip("&").strip()], env)
            processes.append(proc)
            port = sandbox_port if "telegram_sandbox" in command else web_port
            wait_until(
                lambda port=port, proc=proc: _answers(f"http://127.0.0.1:{port}/") or not proc.alive(),
                timeout=60,
                message=command,
            )
            assert proc.alive(), proc.log()
        else:
            outputs.append(_run(command, env))

    # The last command reads what the bot sent; the answer may take a moment.
    assert "Echo: hello" in outputs[-1] or wait_until(
        lambda: "Echo: hello" in _run(commands[-1], env), timeout=60, message="the echo in the sandbox"
    )


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return True


def _run(command: str, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done.stdout
