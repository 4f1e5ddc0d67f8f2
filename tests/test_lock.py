"""The lock files stay in step with the requirements they were compiled from: every pin of
requirements*.txt is in the lock at the same version, with hashes. After editing a
requirements file, `make lock` rewrites both locks."""

from __future__ import annotations

import re

import pytest

from tests.support import ROOT

PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;\\]+)", re.MULTILINE)


def pins(name: str) -> dict[str, str]:
    text = (ROOT / name).read_text()
    return {package.lower().replace("_", "-"): version for package, version in PIN.findall(text)}


@pytest.mark.parametrize(
    ("lock", "sources"),
    [
        ("requirements.lock", ["requirements.txt"]),
        ("requirements-dev.lock", ["requirements.txt", "requirements-demo.txt", "requirements-dev.txt"]),
    ],
)
def test_the_lock_pins_what_the_requirements_pin(lock: str, sources: list[str]) -> None:
    locked = pins(lock)
    wanted = {package: version for source in sources for package, version in pins(source).items()}
    assert {p: v for p, v in wanted.items() if locked.get(p) != v} == {}, f"run `make lock`: {lock} is stale"
    assert "--hash=sha256:" in (ROOT / lock).read_text()
