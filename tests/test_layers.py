"""The layers hold (core < outbox < bots < reconciliation < project, as pyproject.toml's
import-linter contracts say), checked in CI as `make lint` checks them."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_the_import_contracts_are_kept() -> None:
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_an_upward_import_breaks_a_contract(tmp_path: Path) -> None:
    """The check can fail: core importing an app is reported (a copy of the tree, one line added)."""
    copy = tmp_path / "tree"
    for package in ("core", "outbox", "bots", "reconciliation", "project"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    with (copy / "core" / "ids.py").open("a") as f:
        f.write("\nfrom bots import models as _upward  # noqa\n")
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=copy, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "core imports no app BROKEN" in done.stdout
