"""Read-side numbers for operators: queue_status, /metrics and the dashboard."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, Min
from django.utils import timezone

from bots.models import ConsumerRun, InboundUpdate, RunState, UpdateState
from outbox.models import Attempt, Circuit, CircuitState, DeadLetter, DeadLetterStatus, OutboundMessage, State
from reconciliation.models import CaseStatus, ReconciliationCase


def _counts(qs: Any, states: Any) -> dict[str, int]:
    counts = {value: 0 for value, _ in states.choices}
    counts.update({row["state"]: row["n"] for row in qs.values("state").annotate(n=Count("id")).order_by()})
    return counts


def _age(oldest: Any) -> float | None:
    return None if oldest is None else max(0.0, (timezone.now() - oldest).total_seconds())


def queue_status() -> dict[str, Any]:
    """Counts by state for inbox, consumer runs and outbox, dead letters, the age of the
    oldest waiting item, and open reconciliation cases."""
    oldest_message = OutboundMessage.objects.filter(state__in=[State.PENDING, State.RETRY]).aggregate(
        t=Min("created_at")
    )["t"]
    oldest_run = ConsumerRun.objects.filter(state__in=[RunState.PENDING, RunState.RETRY]).aggregate(
        t=Min("created_at")
    )["t"]
    oldest_update = InboundUpdate.objects.filter(state=UpdateState.NEW).aggregate(t=Min("received_at"))["t"]
    ages = [a for a in (_age(oldest_message), _age(oldest_run), _age(oldest_update)) if a is not None]
    dead_letters = DeadLetter.objects.filter(status=DeadLetterStatus.OPEN)
    return {
        "inbox": _counts(InboundUpdate.objects.all(), UpdateState),
        "consumer_runs": _counts(ConsumerRun.objects.all(), RunState),
        "outbox": _counts(OutboundMessage.objects.all(), State),
        "dead_letters": {
            "open": dead_letters.count(),
            "by_reason": {
                row["reason_class"]: row["n"]
                for row in dead_letters.values("reason_class").annotate(n=Count("id")).order_by()
            },
        },
        "oldest_waiting_seconds": max(ages) if ages else None,
        "oldest_waiting": {
            "inbox": _age(oldest_update),
            "consumer_runs": _age(oldest_run),
            "outbox": _age(oldest_message),
        },
        "open_reconciliation_cases": ReconciliationCase.objects.filter(status=CaseStatus.OPEN).count(),
        # Destinations whose circuit is not closed (a bot's Bot API access, a consumer's
        # endpoint): attempts stopped, queue kept. One entry per outage, not per message.
        "circuits_open": {
            row["scope"]: row["state"]
            for row in Circuit.objects.exclude(state=CircuitState.CLOSED).values("scope", "state").order_by("scope")
        },
        "sends_by_outcome": {
            row["outcome"] or "open": row["n"]
            for row in Attempt.objects.values("outcome").annotate(n=Count("id")).order_by()
        },
    }
