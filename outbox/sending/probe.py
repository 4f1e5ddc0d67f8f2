"""A bot's circuit probe, and the release of its backlog when the circuit closes.

Whenever a bot's circuit opens or a probe fails (outbox/circuits.py), a probe task is
published for `next_probe_at` (one per bot: a wake-up key coalesces them). The probe is one
getMe: it spends no message's retry budget and fails exactly as sends would. The sweeper
still wakes a probe for an open circuit whose task was lost.

When the circuit closes, the retries the outage scheduled are made due again where they stood
in the queue and the bot's drain is woken: the backlog leaves in the order it was written, at
the rate limiter's pace, not at the sweeper's ticks. Why: docs/DESIGN.md (`outbox/circuits.py`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import transaction
from django.utils import timezone

from core import wakeups
from core.publishing import publish
from outbox import botapi, circuits, dispatch, policy, transitions
from outbox.models import Circuit, CircuitState

logger = logging.getLogger(__name__)


def probe_key(bot_id: int) -> str:
    return wakeups.key("probe", bot_id)


def schedule_probe(bot_id: int, countdown: float) -> bool:
    """Publish the bot's probe for `countdown` seconds from now, unless one is coming."""
    countdown = max(0.0, min(countdown, policy.MAX_BROKER_COUNTDOWN_SECONDS))
    return wakeups.wake(probe_key(bot_id), lambda: _publish_probe(bot_id, countdown), countdown=countdown) is True


def _publish_probe(bot_id: int, countdown: float) -> bool:
    from outbox.tasks import probe_bot

    return publish(probe_bot, (bot_id,), countdown=countdown, what=f"circuit probe of bot {bot_id}")


def bot_circuit_probe(bot_id: int) -> str:
    """The probe task: when the bot's circuit is open and its probe due, win the half-open
    state and send one getMe; its outcome closes the circuit (the backlog is released) or
    opens it again with the next probe scheduled. Returns what it did."""
    wakeups.release(probe_key(bot_id))
    scope = circuits.bot_scope(bot_id)
    circuit = Circuit.objects.filter(scope=scope).first()
    if circuit is None or circuit.state == CircuitState.CLOSED:
        return "closed"
    if circuit.manual:
        return "paused"  # an operator's pause: no probe until resumed
    now = timezone.now()
    if circuit.next_probe_at is not None and circuit.next_probe_at > now:
        if circuit.state == CircuitState.HALF_OPEN:
            # Another probe is out: its outcome schedules the next one (the sweeper takes
            # over if its worker died). A timer for its lease's end would hold the key.
            return "probing-elsewhere"
        schedule_probe(bot_id, (circuit.next_probe_at - now).total_seconds())  # rescheduled meanwhile
        return "not-due"
    if not circuits.try_probe(scope):
        return "probing-elsewhere"
    from bots.models import Bot

    bot = Bot.objects.filter(pk=bot_id).first()
    if bot is None:
        return "no-bot"
    outcome = botapi.call(token=bot.token, base_url=bot.api_base_url, method="getMe", params={}, bot_name=bot.name)
    if outcome.ok:
        circuits.record_success(scope)
        return "closed-by-probe"
    if outcome.error_class == "auth":
        circuits.open_for_auth(scope, reason=outcome.description)
    else:
        circuits.record_failure(scope, reason=outcome.description)
    return "probe-failed"


def release_backlog(bot_id: int, *, was_open: bool = True) -> int:
    """The bot's circuit closed (`was_open`), or a success ended failures too few to open
    it: the retries its outage scheduled (a transient failure, or the auth refusal) are due
    again, when first due (transitions.make_outage_retries_due), and the drains send them at
    the bot's rate (after a close, also what fell due while it was open). Returns how many
    were made due."""
    replies, broadcasts = transitions.make_outage_retries_due(bot_id, now=timezone.now())
    if was_open or replies:
        dispatch.wake_drain(bot_id)
    if dispatch.drain_enabled() and (was_open or broadcasts):
        dispatch.wake_bulk_drain(bot_id)
    if was_open or replies or broadcasts:
        logger.info("bot %s: %s retries made due, its drains woken", bot_id, replies + broadcasts)
    return replies + broadcasts


def _on_opened(bot_id: int, delay: float) -> None:
    # After the commit that opened it (now, outside a transaction): the probe reads it.
    transaction.on_commit(lambda: _quietly(_reschedule_probe, bot_id, delay))


def _reschedule_probe(bot_id: int, delay: float) -> None:
    """The circuit's probe time was just set: a timer published for another time (a probe
    task that found it half-open, before its probe failed) must not hold the key."""
    wakeups.release(probe_key(bot_id))
    schedule_probe(bot_id, delay)


def _on_closed(bot_id: int, was_open: bool) -> None:
    transaction.on_commit(lambda: _quietly(lambda bot: release_backlog(bot, was_open=was_open), bot_id))


def _quietly(func: Callable[..., object], *args: object) -> None:
    try:
        func(*args)
    except Exception:  # the sweeper probes an open circuit and redispatches what is due
        logger.exception("bot %s: after its circuit moved, %s failed", args[0], getattr(func, "__name__", func))


circuits.on_bot_opened.append(_on_opened)
circuits.on_bot_closed.append(_on_closed)
