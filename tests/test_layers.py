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


def lint_with(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """lint-imports over a copy of the tree with `line` added to `module` (a path)."""
    copy = tmp_path / "tree"
    for package in ("core", "outbox", "bots", "reconciliation", "project"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    with (copy / module).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=copy, capture_output=True, text=True, timeout=120)


def test_an_upward_import_breaks_a_contract(tmp_path: Path) -> None:
    """The check can fail: core importing an app is reported."""
    done = lint_with(tmp_path, "core/ids.py", "from bots import models as _upward")
    assert done.returncode != 0
    assert "core imports no app BROKEN" in done.stdout


def test_bots_importing_an_outbox_module_past_its_surface_breaks_a_contract(tmp_path: Path) -> None:
    """bots may import outbox.services, selectors, models and botapi; any other outbox module
    is reported."""
    done = lint_with(tmp_path, "bots/routing.py", "from outbox import circuits as _inside")
    assert done.returncode != 0
    assert "bots uses the outbox through its surface BROKEN" in done.stdout
