"""One message, its own task: the send of a message dispatched alone (a reserved rate-limit
slot, a broadcast, a circuit's probe), and what every drain-less path uses.
A redelivered task is harmless because the send starts with a claim."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from core.failpoints import failpoint, uncommitted
from core.logs import current_trace_id
from core.workers import lease_keeper, worker_id
from outbox import botapi, circuits, ratelimit, selectors, transitions
from outbox.dispatch import Held, dispatch, drain_enabled, kick_chat
from outbox.models import ErrorClass, OutboundMessage, State
from outbox.sending.rules import (
    EXPIRED_REASON,
    SendResult,
    cancel_reason,
    limited_chat_id,
    record_outcome,
    with_outcome_write_retries,
)

logger = logging.getLogger(__name__)

# A deferral longer than this is also written to the row (next_attempt_at), so the sweeper
# does not take the message for lost and dispatch it a second time meanwhile.
DEFER_IN_ROW_AFTER_SECONDS = 5.0


def outbound_message_send(message_id: int, *, slot_reserved: bool = False, only_if_room: bool = False) -> SendResult:
    """Send one outbound message, at most once per claim. Safe to call any number of times.

    `slot_reserved`: this call comes back at a rate-limit slot reserved for it earlier.
    `only_if_room`: send only if the bot and the chat have room now; else nothing is
    reserved or deferred ("no-room"), and the caller hands the message to the drain.
    """
    worker = worker_id()
    now = timezone.now()
    message = selectors.outbound_message_for_send(message_id, now=now)
    if message is None or message.state not in (State.PENDING, State.RETRY):
        return SendResult("not-waiting")
    current_trace_id.set(message.trace_id)
    if message.next_attempt_at > now:
        # Not this call's turn: a slot reserved for it stays reserved.
        return SendResult("not-due", (message.next_attempt_at - now).total_seconds(), slot_reserved=slot_reserved)
    if message.expires_at and message.expires_at <= now:
        if transitions.cancel(message.pk, reason=EXPIRED_REASON, error_class=ErrorClass.EXPIRED):
            kick_chat(message)
        return SendResult("expired")
    if message.ordered and message.blocked:
        # An earlier message to this chat goes first; it kicks this one when it is done.
        # Checked before the circuit, so that a blocked message never spends the probe.
        return SendResult("waiting-for-earlier")
    if message.circuit_not_closed and not circuits.try_probe(circuits.bot_scope(message.bot_id)):
        # The bot's circuit is open (auth failure or operator pause), or another worker is
        # sending the one half-open probe: keep the queue; the sweeper releases it later.
        return SendResult("circuit-open")
    wait = ratelimit.acquire(
        bot_id=message.bot_id,
        bot_rate=message.bot.rate_limit,
        chat_id=limited_chat_id(message),
        slot_reserved=slot_reserved,
        horizon=ratelimit.SLOT_TOLERANCE_SECONDS if only_if_room else None,
    )
    if wait.seconds > 0 and only_if_room:
        return SendResult("no-room")
    if wait.seconds > 0:
        # Waiting for a slot is not an attempt and does not hold a worker.
        if wait.beyond_horizon or wait.seconds > DEFER_IN_ROW_AFTER_SECONDS:
            transitions.defer(message.pk, until=now + timedelta(seconds=wait.seconds))
        if wait.beyond_horizon:
            return SendResult("rate-limited")  # the sweeper dispatches it when due
        return SendResult("rate-limited", wait.seconds, slot_reserved=wait.slot_reserved)

    # The send's place in the bot's window (and its chat's gate), until its answer came.
    entries = [wait.entry] if wait.entry else []
    lease = timedelta(seconds=settings.DOVECOTE_SEND_LEASE_SECONDS)
    # The claim also checks that nobody changed the row since it was read (updated_at), so
    # the row in hand is what gets sent; otherwise claim as usual and read it again.
    if not _claim(message.pk, worker=worker, lease=lease, unchanged_since=message.updated_at):
        if not _claim(message.pk, worker=worker, lease=lease):
            ratelimit.leave(entries, sent=False)
            return SendResult("claimed-elsewhere")
        failpoint("after_claim")
        message = OutboundMessage.objects.select_related("bot").get(pk=message.pk)
    else:
        failpoint("after_claim")
        message.state, message.lease_owner = State.SENDING, worker

    stop = cancel_reason(message, now=now)  # expiry was checked before the claim: a veto
    if stop:
        ratelimit.leave(entries, sent=False)
        transitions.cancel_claimed(message, worker=worker, reason=stop[0], error_class=stop[1])
        kick_chat(message)
        return SendResult("vetoed")

    # From its attempt until its outcome is recorded the send is this process's: taking up its
    # claims after an outage (reconciliation/resume.py) leaves it alone.
    with lease_keeper.holding("send", [message.pk]):
        attempt = transitions.begin_attempts([message], worker=worker).get(message.pk)
        if attempt is None:
            ratelimit.leave(entries, sent=False)
            return SendResult("lease-lost")
        failpoint("before_request")
        outcome = botapi.call(
            token=message.bot.token,
            base_url=message.bot.api_base_url,
            method=message.method,
            params={"chat_id": message.chat_id, **message.payload},
            bot_name=message.bot.name,
        )
        # Left before the outcome is recorded: the chat's next message, handed on by it, finds
        # the chat's gate as the answer left it.
        ratelimit.leave(entries)
        failpoint("after_response")
        result = with_outcome_write_retries(
            lambda: record_outcome(message, worker=worker, attempt=attempt, outcome=outcome), message_ids=[message.pk]
        )
    failpoint("after_record")
    return result


def _claim(message_id: int, *, worker: str, lease: timedelta, unchanged_since: datetime | None = None) -> bool:
    with uncommitted("before_claim_commit"):
        claimed = transitions.claim(message_id, worker=worker, lease=lease, unchanged_since=unchanged_since)
        if claimed:
            failpoint("before_claim_commit")
    return claimed


# What an inline send leaves for the drain: it could not go now, and nothing else will wake it.
_HAND_ON = frozenset({"no-room", "waiting-for-earlier", "circuit-open"})


def send_held(held: list[tuple[int, int]], *, bots: dict[int, Any] | None = None) -> None:
    """Send, in this worker, the messages it just wrote and committed (dispatch.holding):
    the reply leaves without a Celery hop when the bot has room. With the drain's machinery
    (PostgreSQL and Redis) a bot's messages go as one batch (outbox.sending.batch: three
    statements for the lot), `bots` sparing the read of a bot the caller holds; else one by
    one. What cannot go now is handed on as `dispatch` would have: to the bot's drain, or
    back to the broker at its countdown. Never raises: a message left unsent is due in its
    row, and the sweeper dispatches it."""
    by_bot: dict[int, list[int]] = {}
    for message_id, bot_id in held:
        by_bot.setdefault(bot_id, []).append(message_id)
    batched = drain_enabled()
    claimed = held.claimed if isinstance(held, Held) else {}
    for bot_id, message_ids in by_bot.items():
        if batched:
            _send_batch_now(bot_id, message_ids, (bots or {}).get(bot_id), claimed)
        else:
            for message_id in message_ids:
                _send_now(message_id, bot_id)
    _run_after_sends(held)


def _run_after_sends(held: list[tuple[int, int]]) -> None:
    """What the block that wrote the messages left for after their send (dispatch.after_sends),
    once: each never raises, as the send does not."""
    after = held.after if isinstance(held, Held) else []
    while after:
        then = after.pop(0)
        try:
            then()
        except Exception:
            logger.exception("after the sends of messages %s: bookkeeping failed; it is left undone", held)


def _send_batch_now(bot_id: int, message_ids: list[int], bot: Any, claimed: dict[int, Any]) -> None:
    from outbox.sending.batch import outbound_messages_send_now

    try:
        left = outbound_messages_send_now(bot_id, message_ids, bot=bot, claimed=claimed)
    except Exception:
        # Those it had not claimed yet are the drain's at once, not the sweeper's a grace
        # later (a backlog's tail once waited 30 s so); those it had, the sweeper's.
        logger.exception("messages %s: sending them inline failed; the drain takes them", message_ids)
        left = message_ids
    if left:
        dispatch(left[0], bot_id=bot_id)  # one wake-up of the bot's drain takes them all


def _send_now(message_id: int, bot_id: int) -> None:
    try:
        result = outbound_message_send(message_id, only_if_room=True)
        if result.countdown is not None:
            dispatch(message_id, countdown=result.countdown, slot_reserved=result.slot_reserved)
        elif result.status in _HAND_ON:
            dispatch(message_id, bot_id=bot_id)
    except Exception:
        logger.exception("message %s: sending it inline failed; the sweeper dispatches it", message_id)
