"""Circuit breakers for destinations (a bot's Bot API access, a consumer's endpoint).

Open: attempts stop and the queue is kept; one alert is logged when it opens, not one per
message. After `next_probe_at` work flows again as a probe (half-open): a success closes
the circuit, another failure opens it again for longer. A manual (operator) pause has no
probe time and is only lifted by an operator.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db.models import F
from django.utils import timezone

from outbox.models import Circuit, CircuitState

logger = logging.getLogger(__name__)

FAILURES_TO_OPEN = 10
FIRST_PROBE_SECONDS = 30.0
MAX_PROBE_SECONDS = 600.0


def is_open(scope: str) -> bool:
    now = timezone.now()
    circuit = Circuit.objects.filter(scope=scope, state=CircuitState.OPEN).first()
    return circuit is not None and (circuit.next_probe_at is None or circuit.next_probe_at > now)


def _open(scope: str, *, reason: str) -> float:
    """Open (or keep open, backing off the probe) and return seconds until the next probe."""
    now = timezone.now()
    circuit, _ = Circuit.objects.get_or_create(scope=scope)
    if circuit.manual and circuit.state == CircuitState.OPEN:
        return MAX_PROBE_SECONDS
    was_open = circuit.state == CircuitState.OPEN
    previous = (circuit.next_probe_at - circuit.opened_at).total_seconds() if (
        was_open and circuit.next_probe_at and circuit.opened_at
    ) else 0.0
    delay = min(MAX_PROBE_SECONDS, max(FIRST_PROBE_SECONDS, previous * 2))
    n = Circuit.objects.filter(pk=circuit.pk, manual=False).update(
        state=CircuitState.OPEN,
        reason=reason[:2000],
        opened_at=now,
        next_probe_at=now + timedelta(seconds=delay),
        updated_at=now,
    )
    if n and not was_open:
        # The one alert for this outage.
        logger.error("circuit %s opened: %s", scope, reason, extra={"alert": "circuit_open", "scope": scope})
    return delay


def open_for_auth(scope: str, *, reason: str) -> float:
    return _open(scope, reason=f"auth: {reason}")


def record_failure(scope: str, *, reason: str) -> None:
    circuit, _ = Circuit.objects.get_or_create(scope=scope)
    Circuit.objects.filter(pk=circuit.pk).update(consecutive_failures=F("consecutive_failures") + 1)
    if circuit.consecutive_failures + 1 >= FAILURES_TO_OPEN:
        _open(scope, reason=f"{circuit.consecutive_failures + 1} failures in a row: {reason}")


def record_success(scope: str) -> None:
    # Cheap on the hot path: touches only a circuit that is not already clean.
    n = (
        Circuit.objects.filter(scope=scope, manual=False)
        .exclude(state=CircuitState.CLOSED, consecutive_failures=0)
        .update(state=CircuitState.CLOSED, consecutive_failures=0, next_probe_at=None, reason="")
    )
    if n:
        logger.info("circuit %s closed", scope)


def pause(scope: str, *, reason: str) -> None:
    """An operator's pause: open with no probe until resumed."""
    now = timezone.now()
    Circuit.objects.update_or_create(
        scope=scope,
        defaults={"state": CircuitState.OPEN, "manual": True, "reason": reason, "opened_at": now, "next_probe_at": None},
    )


def resume(scope: str) -> None:
    Circuit.objects.filter(scope=scope).update(
        state=CircuitState.CLOSED, manual=False, consecutive_failures=0, next_probe_at=None, reason=""
    )
