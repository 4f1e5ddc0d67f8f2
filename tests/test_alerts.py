"""The shipped alert rules, checked by Prometheus's own promtool (Debian's `prometheus`
package; scripts/services.sh installs it for `make test`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (apt-get install prometheus; `make test` does it)"
)


def test_the_alert_rules_are_valid_and_each_has_a_summary_and_a_runbook() -> None:
    checked = subprocess.run([PROMTOOL, "check", "rules", str(RULES / "alerts.yml")], capture_output=True, text=True)
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


def test_the_alerts_fire_on_their_series_and_stay_quiet_on_the_others() -> None:
    """deploy/prometheus/alerts_test.yml: an outage pages, a single temporary error does not."""
    tested = subprocess.run(
        [PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=RULES, capture_output=True, text=True, timeout=60
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
