"""The shipped alert rules, checked by Prometheus's own promtool (Debian's `prometheus`
package; scripts/services.sh installs it for `make test`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import require_tool

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool", shutil.which("promtool"), install="`make services` installs Debian's prometheus")


def test_the_alert_rules_are_valid_and_each_has_a_summary_and_a_runbook(promtool: str) -> None:
    checked = subprocess.run([promtool, "check", "rules", str(RULES / "alerts.yml")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    import yaml

    rules = [rule for group in yaml.safe_load((RULES / "alerts.yml").read_text())["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in rules} == {
        "DovecoteQueueAgeGrowing",
        "DovecoteProviderErrors",
        "DovecoteDeadLetters",
        "DovecoteCircuitOpen",
        "DovecoteReconciliationCaseOld",
        "DovecoteSweeperSilent",
    }
    for rule in rules:
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["runbook"].startswith(("ADMIN/", "/admin/")), rule["alert"]


def test_the_alerts_fire_on_their_series_and_stay_quiet_on_the_others(promtool: str) -> None:
    """deploy/prometheus/alerts_test.yml: an outage pages, a single temporary error does not."""
    tested = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"], cwd=RULES, capture_output=True, text=True, timeout=60
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
