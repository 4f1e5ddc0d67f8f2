"""tests.support.require_tool: a test whose tool (promtool, pgbouncer, Chromium, RabbitMQ ...)
is missing is skipped on a developer's machine and fails the run under CI (CI=true), with one
message naming the tool and how `make services` gets it. Before, such tests skipped in CI
too, and CI stayed green with them never run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT, VENV_BIN, base_env, require_tool

NOWHERE = "dovecote-no-such-tool"
MESSAGE = f"{NOWHERE} is not installed: `make services` installs it"


def test_a_tool_that_is_found_is_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert require_tool("openssl", "/usr/bin/openssl", install="`make services` installs it") == "/usr/bin/openssl"


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_a_missing_tool_skips_the_test_outside_ci(monkeypatch: pytest.MonkeyPatch, ci: str | None) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_tool(NOWHERE, None, install="`make services` installs it")
    assert str(skipped.value) == MESSAGE


@pytest.mark.parametrize("ci", ["true", "1", "TRUE", "yes"])
def test_a_missing_tool_fails_the_test_in_ci(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception) as failed:
        require_tool(NOWHERE, None, install="`make services` installs it")
    assert str(failed.value) == MESSAGE


def test_a_tool_that_does_not_work_says_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"^RabbitMQ is not reachable at amqp://x \(refused\): start it$"):
        require_tool("RabbitMQ", False, install="start it", missing="is not reachable at amqp://x (refused)")


NEEDS_A_MISSING_TOOL = f"""
import shutil

from tests.support import require_tool


def test_needs_it():
    require_tool("{NOWHERE}", shutil.which("{NOWHERE}"), install="`make services` installs it")
"""


@pytest.mark.parametrize(("ci", "status", "outcome"), [("", 0, "1 skipped"), ("true", 1, "1 failed")])
def test_a_run_with_a_missing_tool_passes_outside_ci_and_fails_in_it(
    tmp_path: Path, ci: str, status: int, outcome: str
) -> None:
    (tmp_path / "test_needs_a_tool.py").write_text(NEEDS_A_MISSING_TOOL)
    env = {**base_env(CI=ci), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-m", "pytest", "-p", "no:django", "-p", "no:cacheprovider", "-rsf", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == status, done.stdout + done.stderr
    assert outcome in done.stdout.splitlines()[-1]
    assert MESSAGE in done.stdout
