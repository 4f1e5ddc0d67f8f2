"""The batched drain: one task sends a bot's due messages in batches.

`outbound_message_send` pays Celery's dispatch, five round trips and two commits per message.
The drain pays them per batch: one statement claims up to DOVECOTE_DRAIN_BATCH_SIZE due
messages of a bot (FOR UPDATE SKIP LOCKED, so drains on other workers take other rows), one
statement writes their attempt rows, the requests go out together on the process's event
loop, and the successes are recorded in one statement as their answers come in. Every rule
of the single send still holds, in the same order and through the same transitions: the
claim and the attempt rows are two commits before any request (the sweeper's recovery
depends on it), a chat's ordered messages go one at a time, expired messages are
cancelled, the relevance check may veto, each message takes its rate-limit slot, and a
failed send is decided by `services._record_outcome` exactly as a single one is.

Waking a drain is coalesced per bot: `wake()` publishes a drain task only when none is
queued for that bot (a Redis key set with NX, deleted by the drain as it starts), so a
burst of a thousand enqueued messages costs a handful of tasks instead of a thousand. A
drain that leaves work behind (its time budget ran out, or the rate limit holds the rest)
publishes its own continuation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache

from django.conf import settings
from django.db import connection
from django.utils import timezone

from outbox import circuits, policy, ratelimit, services, telegram, transitions
from outbox.failpoints import failpoint
from outbox.logging import current_trace_id
from outbox.models import Attempt, Circuit, CircuitState, ErrorClass, OutboundMessage
from outbox.publishing import publish

logger = logging.getLogger(__name__)

# A drain hands the worker back after this long, publishing its continuation, so that other
# bots' drains and the inbox's tasks get their turn on a busy worker.
TIME_BUDGET_SECONDS = 10.0
# Answers arriving within this long of the first are recorded by one statement.
RECORD_GATHER_SECONDS = 0.05
# The wake-up key outlives a drain task lost with its broker message by at most this long;
# the sweeper redispatches what such a loss left due meanwhile.
WAKE_KEY_TTL_MS = 10_000
# Outcomes after which this drain stops and leaves the rest to the retry schedule.
_STOPS_THE_DRAIN = frozenset({ErrorClass.RATE_LIMITED, ErrorClass.AUTH})


def enabled() -> bool:
    """The drain needs PostgreSQL (SKIP LOCKED) and Redis (the wake-up key); the demo's
    SQLite and file broker send one message per task."""
    return settings.DOVECOTE_DRAIN_BATCH_SIZE > 1 and bool(settings.REDIS_URL) and connection.vendor == "postgresql"


@cache
def _redis():
    import redis

    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def _wake_key(bot_id: int) -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:drain:{bot_id}"


def wake(bot_id: int) -> bool:
    """Have a drain of this bot run soon. Never raises: when the broker (Redis) is down the
    messages stay due in their rows and the sweeper dispatches them."""
    import redis

    key = _wake_key(bot_id)
    try:
        if not _redis().set(key, b"1", nx=True, px=WAKE_KEY_TTL_MS):
            return True  # a drain is queued and has not started yet: it will see the message
    except redis.RedisError as exc:
        logger.warning("could not wake the drain of bot %s: %s", bot_id, exc)
        return False
    if _publish(bot_id):
        return True
    with contextlib.suppress(redis.RedisError):  # else it expires
        _redis().delete(key)
    return False


def _publish(bot_id: int, countdown: float = 0.0) -> bool:
    from outbox.tasks import drain_bot

    return publish(drain_bot, (bot_id,), {}, countdown=countdown, what=f"drain of bot {bot_id}")


@dataclass
class DrainReport:
    """What one drain did, for its task's result and the logs."""

    sent: int = 0
    failed: int = 0
    deferred: int = 0
    cancelled: int = 0
    batches: int = 0
    continuation: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"sent={self.sent} failed={self.failed} deferred={self.deferred} cancelled={self.cancelled}"
        text += f" batches={self.batches}"
        if self.outcomes:
            text += " (" + ", ".join(f"{name}={n}" for name, n in sorted(self.outcomes.items())) + ")"
        if self.continuation is not None:
            text += f" continues-in={self.continuation:.2f}s"
        return text


def outbound_messages_drain(bot_id: int, *, batch_size: int | None = None) -> DrainReport:
    """Send the bot's due messages, a batch at a time, until none is left, the rate limit
    holds the rest, or the time budget is spent (then a continuation is published)."""
    import redis

    # From here on, a new message needs a new drain: this one may have claimed already.
    # (Should Redis fail, the key expires; this drain runs anyway.)
    with contextlib.suppress(redis.RedisError):
        _redis().delete(_wake_key(bot_id))
    from bots.models import Bot

    bot = Bot.objects.filter(pk=bot_id).first()
    report = DrainReport()
    if bot is None:
        return report
    size = batch_size or settings.DOVECOTE_DRAIN_BATCH_SIZE
    lease = timedelta(seconds=settings.DOVECOTE_SEND_LEASE_SECONDS)
    worker = services.worker_id()
    started = time.monotonic()
    while True:
        circuit = Circuit.objects.filter(scope=services._circuit_scope(bot_id)).first()
        messages = transitions.claim_batch(
            bot_id=bot_id,
            worker=worker,
            lease=lease,
            limit=size,
            due_since=circuits.ramping_since(circuit, rate=bot.rate_limit),
        )
        if not messages:
            return report
        failpoint("after_claim")
        report.batches += 1
        full = len(messages) == size
        if full:
            # There may be more: let another worker process take the next batch while this
            # one sends (coalesced as any wake-up; a rate-limited bot stops fanning out at
            # once, since its batches come back held).
            wake(bot_id)
        for message in messages:
            message._state.fields_cache["bot"] = bot
        # A circuit with failures to forget: this batch's successes must reset it.
        dirty = circuit is not None and not (circuit.state == CircuitState.CLOSED and circuit.consecutive_failures == 0)
        wait = _send_batch(bot, messages, worker=worker, report=report, circuit_dirty=dirty)
        if wait is not None:
            # The rate limit or Telegram holds the bot: come back when it lets go. Each
            # deferred message has its own wake-up, but the rest of the backlog, and the
            # next message of a chat whose message just went, have only this one.
            report.continuation = min(wait, policy.MAX_BROKER_COUNTDOWN_SECONDS)
            _publish(bot_id, countdown=report.continuation)
            return report
        if full and time.monotonic() - started > TIME_BUDGET_SECONDS:
            report.continuation = 0.0
            _publish(bot_id)
            return report


def _send_batch(
    bot, messages: list[OutboundMessage], *, worker: str, report: DrainReport, circuit_dirty: bool
) -> float | None:
    """Send one claimed batch. Returns how long the bot is held (a rate-limit wait or a
    429), or None when the drain may go straight on."""
    now = timezone.now()
    ready: list[OutboundMessage] = []
    for message in messages:
        current_trace_id.set(message.trace_id)
        if message.expires_at and message.expires_at <= now:
            reason = "expired: not sent before expires_at"
            if transitions.cancel_claimed(message, worker=worker, reason=reason, error_class=ErrorClass.EXPIRED):
                report.cancelled += 1
            continue
        veto = services._relevance_veto(message)
        if veto:
            reason = f"not relevant: {veto}"
            if transitions.cancel_claimed(message, worker=worker, reason=reason, error_class="vetoed"):
                report.cancelled += 1
            continue
        ready.append(message)
    go, held = _take_slots(bot, ready, worker=worker, report=report)
    attempts = transitions.begin_attempts(go, worker=worker)
    failpoint("before_request")
    futures = {
        telegram.submit(
            token=bot.token,
            base_url=bot.api_base_url,
            method=message.method,
            params={"chat_id": message.chat_id, **message.payload},
        ): message
        for message in go
        if message.pk in attempts
    }
    deadline = time.monotonic() + telegram.send_timeout()
    pending = set(futures)
    first = True
    while pending:
        done, pending = concurrent.futures.wait(
            pending, timeout=max(0.0, deadline - time.monotonic()), return_when=concurrent.futures.FIRST_COMPLETED
        )
        if pending and done:
            # Gather the answers that come soon after, to record them in one statement; a
            # slow request does not keep the others' outcomes waiting for more than this.
            more, pending = concurrent.futures.wait(pending, timeout=RECORD_GATHER_SECONDS)
            done |= more
        if first:
            failpoint("after_response")
            first = False
        if not done:
            # Our wait ran out: the requests still out may well have reached Telegram.
            outcomes = [(futures[f], telegram.outcome_of_lost_wait(TimeoutError())) for f in pending]
            pending = set()
        else:
            outcomes = [(futures[f], f.result()) for f in done]
        held = _record(outcomes, attempts, worker=worker, report=report, held=held)
    if circuit_dirty and report.sent:
        circuits.record_success(services._circuit_scope(bot.pk))
    failpoint("after_record")
    return held


def _take_slots(
    bot, messages: list[OutboundMessage], *, worker: str, report: DrainReport
) -> tuple[list[OutboundMessage], float | None]:
    """Each message's rate-limit slot, as the single send takes it. Messages that must wait
    go back to waiting, due at their slot (in the row, so that no drain takes them early),
    with a wake-up of their own for then; returns the ones that go now, and the longest wait."""
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        # Only a 429's pause applies: one look for the whole batch.
        paused = ratelimit.bot_paused_for(bot.pk)
        if paused <= 0:
            return messages, None
        waits = [(m, ratelimit.Wait(paused)) for m in messages]
        return [], _hold(waits, worker=worker, report=report)
    go: list[OutboundMessage] = []
    waits: list[tuple[OutboundMessage, ratelimit.Wait]] = []
    for message in messages:
        wait = ratelimit.acquire(
            bot_id=bot.pk,
            bot_rate=bot.rate_limit,
            chat_id=message.chat_id if message.method in services.CREATES_MESSAGE else None,
        )
        if wait.seconds > 0:
            waits.append((message, wait))
        else:
            go.append(message)
    return go, _hold(waits, worker=worker, report=report)


def _hold(waits: list[tuple[OutboundMessage, ratelimit.Wait]], *, worker: str, report: DrainReport) -> float | None:
    if not waits:
        return None
    now = timezone.now()
    for message, wait in waits:
        if transitions.release(message, worker=worker, next_attempt_at=now + timedelta(seconds=wait.seconds)):
            report.deferred += 1
            if not wait.beyond_horizon:
                services.dispatch(message.pk, countdown=wait.seconds, slot_reserved=wait.slot_reserved)
            # Beyond the horizon the row holds the wait and the sweeper dispatches it when due.
    return max(wait.seconds for _, wait in waits)


def _record(
    outcomes: list[tuple[OutboundMessage, telegram.CallOutcome]],
    attempts: dict[int, Attempt],
    *,
    worker: str,
    report: DrainReport,
    held: float | None,
) -> float | None:
    sent = [(m, attempts[m.pk], o) for m, o in outcomes if o.ok]
    report.sent += len(transitions.mark_sent_many(sent, worker=worker))
    for message, outcome in outcomes:
        if outcome.ok:
            continue
        report.failed += 1
        report.outcomes[outcome.error_class] = report.outcomes.get(outcome.error_class, 0) + 1
        current_trace_id.set(message.trace_id)
        result = services._record_outcome(message, worker=worker, attempt=attempts[message.pk], outcome=outcome)
        if result.countdown is not None:
            services.dispatch(message.pk, countdown=result.countdown, slot_reserved=result.slot_reserved)
        if outcome.error_class in _STOPS_THE_DRAIN:
            wait = result.countdown if result.countdown is not None else policy.MAX_BROKER_COUNTDOWN_SECONDS
            held = max(held or 0.0, wait)
    return held
