"""Circuit breakers for destinations (a bot's Bot API access: ``bot:<id>``; a consumer's
endpoint: ``consumer:<name>``).

closed -> open: an auth error, or FAILURES_TO_OPEN failures in a row; the queue is kept and one
alert is logged per opening. open -> half_open: at ``next_probe_at`` one caller wins and sends a
single probe (a bot's: outbox/sending/probe.py). half_open -> closed on success: the bot's
backlog is released through its drain (`on_bot_closed`). half_open -> open on failure, the next
probe waiting twice as long, up to DOVECOTE_CIRCUIT_MAX_PROBE_SECONDS. A manual pause has no
probe and is lifted only by `resume`. The state machine: docs/ARCHITECTURE.md; why:
docs/DESIGN.md."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from core.ids import int64_or_none
from outbox.models import Circuit, CircuitState

logger = logging.getLogger(__name__)

FAILURES_TO_OPEN = 10


def _first_probe() -> float:
    return float(settings.DOVECOTE_CIRCUIT_FIRST_PROBE_SECONDS)


def _max_probe() -> float:
    return float(settings.DOVECOTE_CIRCUIT_MAX_PROBE_SECONDS)


def _probe_lease(scope: str) -> float:
    """How long a probe holds the circuit half-open. A bot's probe is one Bot API call, over
    within its timeouts: a probe whose worker died is replaced after that, not after the
    setting meant for a consumer's probe (a whole run)."""
    lease = float(settings.DOVECOTE_CIRCUIT_PROBE_LEASE_SECONDS)
    if scope.startswith(BOT_PREFIX):
        call = settings.DOVECOTE_TELEGRAM_CONNECT_TIMEOUT + settings.DOVECOTE_TELEGRAM_READ_TIMEOUT
        return min(lease, call + BOT_PROBE_MARGIN_SECONDS)
    return lease


BOT_PROBE_MARGIN_SECONDS = 5.0


_NOT_CLOSED = (CircuitState.OPEN, CircuitState.HALF_OPEN)

# A circuit's scope names its destination; these are the only places that spell it.
BOT_PREFIX = "bot:"
CONSUMER_PREFIX = "consumer:"


def bot_scope(bot_id: int) -> str:
    """The scope of a bot's Bot API access."""
    return f"{BOT_PREFIX}{bot_id}"


def consumer_scope(name: str) -> str:
    """The scope of a consumer's endpoint."""
    return f"{CONSUMER_PREFIX}{name}"


def parse_scope(scope: str) -> tuple[str, int | str] | None:
    """("bot", bot id) or ("consumer", name) for a well-formed scope, else None."""
    if scope.startswith(BOT_PREFIX):
        bot_id = int64_or_none(scope[len(BOT_PREFIX) :])
        return None if bot_id is None else ("bot", bot_id)
    if scope.startswith(CONSUMER_PREFIX) and len(scope) > len(CONSUMER_PREFIX):
        return "consumer", scope[len(CONSUMER_PREFIX) :]
    return None


def allow(scope: str) -> bool:
    """May a call to this destination go out now? True when closed, or when this caller
    has just won the single half-open probe."""
    circuit = Circuit.objects.filter(scope=scope).only("state", "manual", "next_probe_at").first()
    if circuit is None or circuit.state == CircuitState.CLOSED:
        return True
    return try_probe(scope)


def try_probe(scope: str) -> bool:
    """open|half_open (probe due) -> half_open, won by exactly one caller."""
    now = timezone.now()
    n = Circuit.objects.filter(
        scope=scope, state__in=_NOT_CLOSED, manual=False, next_probe_at__isnull=False, next_probe_at__lte=now
    ).update(
        state=CircuitState.HALF_OPEN,
        next_probe_at=now + timedelta(seconds=_probe_lease(scope)),
        updated_at=now,
    )
    if n == 1:
        logger.info("circuit %s half-open: sending one probe", scope, extra={"scope": scope})
    return n == 1


def _open(scope: str, *, reason: str) -> float:
    """Open (or keep open, backing off the probe) and return seconds until the next probe."""
    now = timezone.now()
    circuit, _ = Circuit.objects.get_or_create(scope=scope)
    if circuit.manual and circuit.state == CircuitState.OPEN:
        return _max_probe()
    # closed -> open: the one alert for this outage, logged by whoever wins the UPDATE.
    n = Circuit.objects.filter(pk=circuit.pk, state=CircuitState.CLOSED, manual=False).update(
        state=CircuitState.OPEN,
        reason=reason[:2000],
        opened_at=now,
        next_probe_at=now + timedelta(seconds=_first_probe()),
        updated_at=now,
    )
    if n == 1:
        logger.error("circuit %s opened: %s", scope, reason, extra={"alert": "circuit_open", "scope": scope})
        return _first_probe()
    # Already open or probing: a failed probe doubles the wait; other late failures of
    # the same outage leave the schedule alone.
    circuit.refresh_from_db()
    if circuit.state == CircuitState.HALF_OPEN and circuit.opened_at:
        delay = min(_max_probe(), max(_first_probe(), 2 * (now - circuit.opened_at).total_seconds()))
        Circuit.objects.filter(pk=circuit.pk, state=CircuitState.HALF_OPEN, manual=False).update(
            state=CircuitState.OPEN,
            reason=reason[:2000],
            next_probe_at=now + timedelta(seconds=delay),
            updated_at=now,
        )
        logger.warning("circuit %s probe failed; next probe in %.0fs", scope, delay, extra={"scope": scope})
        return delay
    if circuit.next_probe_at:
        return max(0.0, (circuit.next_probe_at - now).total_seconds())
    return _max_probe()


def open_for_auth(scope: str, *, reason: str) -> float:
    delay = _open(scope, reason=f"auth: {reason}")
    _opened(scope, delay)
    return delay


def record_failure(scope: str, *, reason: str) -> float | None:
    """Count a failure; open the circuit at FAILURES_TO_OPEN in a row (or when a probe
    failed). Returns the seconds until its next probe while it is open, else None."""
    circuit, _ = Circuit.objects.get_or_create(scope=scope)
    Circuit.objects.filter(pk=circuit.pk).update(consecutive_failures=F("consecutive_failures") + 1)
    if circuit.state == CircuitState.HALF_OPEN or circuit.consecutive_failures + 1 >= FAILURES_TO_OPEN:
        delay = _open(scope, reason=f"{circuit.consecutive_failures + 1} failures in a row: {reason}")
        _opened(scope, delay)
        return delay
    return None


# Called with (bot id, seconds until the next probe) when a bot's circuit opens or a probe
# fails, and with the bot id and whether it was open when it closes (or a success ends a
# run of failures too few to open it): the
# sending side schedules the probe and releases the backlog (outbox/sending/probe.py
# registers them; this module sends nothing).
on_bot_opened: list[Callable[[int, float], None]] = []
on_bot_closed: list[Callable[[int, bool], None]] = []


def _opened(scope: str, delay: float) -> None:
    parsed = parse_scope(scope)
    if parsed is not None and parsed[0] == "bot":
        for hook in on_bot_opened:
            hook(int(parsed[1]), delay)


def _closed(scope: str, *, was_open: bool = True) -> None:
    parsed = parse_scope(scope)
    if parsed is not None and parsed[0] == "bot":
        for hook in on_bot_closed:
            hook(int(parsed[1]), was_open)


def record_success(scope: str) -> None:
    # Called only for a circuit that is not already clean (the callers read it so). A
    # close (open|half_open -> closed), or failures forgotten, is told to `on_bot_closed`
    # once: the UPDATE that does it decides who.
    now = timezone.now()
    closed = Circuit.objects.filter(scope=scope, manual=False, state__in=_NOT_CLOSED).update(
        state=CircuitState.CLOSED, consecutive_failures=0, next_probe_at=None, reason="", updated_at=now
    )
    if closed:
        logger.info("circuit %s closed", scope, extra={"scope": scope})
        _closed(scope)
        return
    reset = Circuit.objects.filter(scope=scope, state=CircuitState.CLOSED, consecutive_failures__gt=0).update(
        consecutive_failures=0
    )
    if reset:
        # Failures short of opening it, then a success: the destination answers again, and
        # what those failures put off need not wait out its backoff either.
        _closed(scope, was_open=False)


def pause(scope: str, *, reason: str) -> None:
    """An operator's pause: open with no probe until resumed."""
    now = timezone.now()
    Circuit.objects.update_or_create(
        scope=scope,
        defaults={
            "state": CircuitState.OPEN,
            "manual": True,
            "reason": reason,
            "opened_at": now,
            "next_probe_at": None,
        },
    )


def resume(scope: str) -> None:
    """An operator lifts a pause (or an outage they fixed): closed, and the backlog released."""
    n = (
        Circuit.objects.filter(scope=scope)
        .exclude(state=CircuitState.CLOSED, manual=False)
        .update(
            state=CircuitState.CLOSED,
            manual=False,
            consecutive_failures=0,
            next_probe_at=None,
            reason="",
            updated_at=timezone.now(),
        )
    )
    if n:
        _closed(scope)
