"""Current-state gauges for /metrics and the dashboard, read with a fixed handful of cheap
queries: each reads only waiting or open rows (partial indexes, or the state index), never
the finished history, so a scrape costs the same at 1 M outbox rows as at 100
(bench/metrics_scrape.py, docs/PERFORMANCE.md). What happened (sends, retries, dead letters)
is counted as it happens, in core/metrics.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.db.models import Count, Min
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from bots.models import Bot, ConsumerRun, InboundUpdate, RunState, UpdateState
from outbox.circuits import bot_scope
from outbox.models import Circuit, CircuitState, DeadLetter, DeadLetterStatus, OutboundMessage, State
from reconciliation.models import CaseStatus, ReconciliationCase
from reconciliation.sweeper import sweeper_last_run

OUTBOX_WAITING = [State.PENDING, State.RETRY, State.SENDING]
RUNS_WAITING = [RunState.PENDING, RunState.RETRY, RunState.RUNNING]


def _age(now: datetime, oldest: datetime | None) -> float | None:
    return None if oldest is None else max(0.0, (now - oldest).total_seconds())


def current_state() -> dict[str, Any]:
    """Backlog by state (overall and per bot), oldest waiting item by queue and bot, open
    dead letters by reason, open cases and the oldest one's age, circuits not closed: seven
    queries whatever the table sizes or the number of bots."""
    now = timezone.now()
    names = dict(Bot.objects.values_list("pk", "name"))
    outbox = {str(s): 0 for s in OUTBOX_WAITING}
    per_bot: dict[str, dict[str, int]] = {name: {str(s): 0 for s in OUTBOX_WAITING} for name in names.values()}
    bot_oldest: dict[str, float | None] = dict.fromkeys(names.values())
    oldest_outbox: datetime | None = None
    rows = (
        OutboundMessage.objects.filter(state__in=OUTBOX_WAITING)
        .values("bot_id", "state")
        .annotate(n=Count("id"), oldest=Min("created_at"))
        .order_by()
    )
    for row in rows:
        name = names.get(row["bot_id"], str(row["bot_id"]))
        outbox[row["state"]] += row["n"]
        per_bot.setdefault(name, {str(s): 0 for s in OUTBOX_WAITING})[row["state"]] += row["n"]
        if row["state"] in (State.PENDING, State.RETRY):
            age = _age(now, row["oldest"])
            bot_oldest[name] = max(bot_oldest.get(name) or 0.0, age or 0.0)
            if oldest_outbox is None or row["oldest"] < oldest_outbox:
                oldest_outbox = row["oldest"]

    runs = {str(s): 0 for s in RUNS_WAITING}
    oldest_run: datetime | None = None
    for row in (
        ConsumerRun.objects.filter(state__in=RUNS_WAITING)
        .values("state")
        .annotate(n=Count("id"), oldest=Min("created_at"))
        .order_by()
    ):
        runs[row["state"]] = row["n"]
        if row["state"] != RunState.RUNNING and (oldest_run is None or row["oldest"] < oldest_run):
            oldest_run = row["oldest"]

    inbox = InboundUpdate.objects.filter(state=UpdateState.NEW).aggregate(n=Count("id"), oldest=Min("received_at"))
    letters: dict[str, int] = {}
    letters_by_bot: dict[tuple[str, str], int] = {}
    for row in (
        DeadLetter.objects.filter(status=DeadLetterStatus.OPEN)
        .values("bot_id", "reason_class")
        .annotate(n=Count("id"))
        .order_by()
    ):
        letters[row["reason_class"]] = letters.get(row["reason_class"], 0) + row["n"]
        bot = names.get(row["bot_id"], str(row["bot_id"]))
        letters_by_bot[(bot, row["reason_class"])] = row["n"]
    cases = ReconciliationCase.objects.filter(status=CaseStatus.OPEN).aggregate(n=Count("id"), oldest=Min("created_at"))
    circuits = list(
        Circuit.objects.exclude(state=CircuitState.CLOSED).values("scope", "state", "manual").order_by("scope")
    )
    bot_scopes = {bot_scope(pk): name for pk, name in names.items()}
    return {
        "outbox": outbox,
        "outbox_by_bot": per_bot,
        "consumer_runs": runs,
        "inbox": {str(UpdateState.NEW): inbox["n"]},
        "oldest_waiting": {
            "inbox": _age(now, inbox["oldest"]),
            "consumer_runs": _age(now, oldest_run),
            "outbox": _age(now, oldest_outbox),
        },
        "oldest_waiting_by_bot": bot_oldest,
        "dead_letters_by_reason": letters,
        "dead_letters_by_bot": letters_by_bot,
        "cases_open": cases["n"],
        "oldest_open_case_seconds": _age(now, cases["oldest"]),
        "circuits": [
            {**c, "label": f"bot {bot_scopes[c['scope']]}" if c["scope"] in bot_scopes else c["scope"]}
            for c in circuits
        ],
    }


def _gauge(name: str, doc: str, labels: list[str], samples: list[tuple[list[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


class StateCollector(Collector):
    """The gauges of /metrics, computed at scrape time in the web process."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = current_state()
        for queue in ("inbox", "consumer_runs", "outbox"):
            yield _gauge(
                f"dovecote_{queue}_items",
                f"{queue} rows waiting or in progress, by state",
                ["state"],
                [([s], n) for s, n in state[queue].items()],
            )
        yield _gauge(
            "dovecote_bot_outbox_items",
            "outbox rows waiting or in progress, by bot and state",
            ["bot", "state"],
            [([bot, s], n) for bot, by_state in state["outbox_by_bot"].items() for s, n in by_state.items()],
        )
        yield _gauge(
            "dovecote_oldest_waiting_seconds",
            "age of the oldest waiting item by queue (0 when none waits)",
            ["queue"],
            [([q], age or 0.0) for q, age in state["oldest_waiting"].items()],
        )
        yield _gauge(
            "dovecote_bot_oldest_waiting_seconds",
            "age of the bot's oldest waiting outbox message (0 when none waits)",
            ["bot"],
            [([bot], age or 0.0) for bot, age in state["oldest_waiting_by_bot"].items()],
        )
        letters = state["dead_letters_by_reason"]
        yield _gauge("dovecote_dead_letters_open", "open dead letters", [], [([], sum(letters.values()))])
        yield _gauge(
            "dovecote_dead_letters_open_by_reason",
            "open dead letters by reason",
            ["reason"],
            [([r], n) for r, n in letters.items()],
        )
        yield _gauge(
            "dovecote_bot_dead_letters_open",
            "open dead letters by bot and reason",
            ["bot", "reason"],
            [([bot, r], n) for (bot, r), n in state["dead_letters_by_bot"].items()],
        )
        yield _gauge("dovecote_reconciliation_cases_open", "open reconciliation cases", [], [([], state["cases_open"])])
        yield _gauge(
            "dovecote_reconciliation_oldest_open_case_seconds",
            "age of the oldest open reconciliation case (0 when none is open)",
            [],
            [([], state["oldest_open_case_seconds"] or 0.0)],
        )
        yield _gauge(
            "dovecote_circuit_open",
            "1 while a destination's circuit is open or half-open (attempts stopped, queue kept)",
            ["scope", "state"],
            [([c["label"], c["state"]], 1) for c in state["circuits"]],
        )
        yield _gauge(
            "dovecote_circuit_paused",
            "1 while an operator has paused the bot or consumer by hand",
            ["scope"],
            [([c["label"]], 1) for c in state["circuits"] if c["manual"] and c["state"] == CircuitState.OPEN],
        )
        last_run = sweeper_last_run()
        yield _gauge(
            "dovecote_sweeper_last_run_timestamp_seconds",
            "when the sweeper last finished a sweep (Unix time; 0 if never): alert when it falls behind",
            [],
            [([], last_run.timestamp() if last_run else 0)],
        )
