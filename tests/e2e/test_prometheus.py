"""Monitoring end to end: a real Prometheus (Debian's binary) scrapes a running Dovecote
every second with the shipped alert rules, and a 502 outage of the Bot API sandbox makes
the provider-error alert fire. The sends are counted by a Celery worker that shares no
directory with gunicorn, as on a Procfile platform's separate dynos: its counts reach
/metrics through Redis only."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest

from outbox.models import OutboundMessage, State
from outbox.services import outbound_message_enqueue
from tests.support import METRICS_AUTH, Process, free_port, require_tool, start_web, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def _fast_rules(path: Path) -> None:
    """The shipped rules with every `for:` cut to 5 s, so a test sees them fire."""
    path.write_text(re.sub(r"(?m)^(\s+)for: \S+$", r"\1for: 5s", ALERTS.read_text()))


@pytest.fixture
def prometheus_binary() -> str:
    """Asked first, so that a missing Prometheus stops the test before its processes start."""
    return require_tool(
        "prometheus", shutil.which("prometheus"), install="`make services` installs Debian's prometheus"
    )


def _start_prometheus(binary: str, tmp_path: Path, target: str) -> tuple[Process, str]:
    _fast_rules(tmp_path / "alerts.yml")
    token = METRICS_AUTH["Authorization"].removeprefix("Bearer ")
    (tmp_path / "prometheus.yml").write_text(
        f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [alerts.yml]
scrape_configs:
  - job_name: dovecote
    metrics_path: /metrics
    authorization: {{type: Bearer, credentials: "{token}"}}
    static_configs: [{{targets: ["{target}"]}}]
"""
    )
    port = free_port()
    proc = Process(
        "prometheus",
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        {"PATH": "/usr/bin:/bin"},
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"prometheus died:\n{proc.log()}")
        try:
            return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout=20, message="prometheus ready")
    return proc, url


def _alerts(url: str) -> dict[str, str]:
    alerts = httpx.get(f"{url}/api/v1/alerts", timeout=2).json()["data"]["alerts"]
    return {a["labels"]["alertname"] + ":" + a["labels"].get("bot", ""): a["state"] for a in alerts}


def test_a_502_outage_fires_the_provider_error_alert_in_a_real_prometheus(
    prometheus_binary: str, process_env: dict, processes: list, sandbox, bot_factory, tmp_path: Path
) -> None:
    env = {**process_env, "DOVECOTE_RETRY_MAX_SECONDS": "3"}
    web, web_url = start_web(env)
    processes.append(web)
    processes.append(start_worker(env))
    prometheus, prom_url = _start_prometheus(prometheus_binary, tmp_path, web_url.removeprefix("http://"))
    processes.append(prometheus)
    bot = bot_factory()

    # A healthy send first: its series exist before the outage, so rate() sees the errors.
    first, _ = outbound_message_enqueue(bot_id=bot.pk, chat_id=1, payload={"text": "ok"}, idempotency_key="ok")
    wait_until(lambda: OutboundMessage.objects.get(pk=first.pk).state == State.SENT, timeout=20)

    def transient_at_zero_in_prometheus() -> bool:
        query = f'dovecote_sends_total{{bot="{bot.name}",outcome="transient"}}'
        result = httpx.get(f"{prom_url}/api/v1/query", params={"query": query}, timeout=2).json()["data"]["result"]
        return bool(result) and result[0]["value"][1] == "0"

    wait_until(transient_at_zero_in_prometheus, timeout=15, message="Prometheus scraped the worker's counters")

    sandbox.fault("5xx", status=502, count=60)
    for i in range(6):
        outbound_message_enqueue(bot_id=bot.pk, chat_id=100 + i, payload={"text": f"m{i}"}, idempotency_key=f"o{i}")

    key = f"DovecoteProviderErrors:{bot.name}"
    seen: list[str] = []

    def fired() -> bool:
        state = _alerts(prom_url).get(key)
        if state and (not seen or seen[-1] != state):
            seen.append(state)
        return state == "firing"

    try:
        wait_until(fired, timeout=45, interval=1, message=f"{key} firing in Prometheus (seen: {seen})")
    except AssertionError:
        targets = httpx.get(f"{prom_url}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
        sends = [
            httpx.get(f"{prom_url}/api/v1/query", params={"query": q}, timeout=2).json()["data"]["result"]
            for q in (
                "dovecote_sends_total[1m]",
                'sum by (bot) (rate(dovecote_sends_total{outcome=~"transient|ambiguous"}[5m]))',
                'sum by (bot) (increase(dovecote_sends_total{outcome=~"transient|ambiguous"}[5m]))',
            )
        ]
        raise AssertionError(f"seen {seen}; targets {targets}; sends {sends}; rules {_alerts(prom_url)}") from None
    assert seen[0] in ("pending", "firing")
