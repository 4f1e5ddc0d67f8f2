"""The rules both send paths follow: which chat's flood limit a call counts against, why a
claimed message is cancelled instead of sent, how an answer of Telegram (or its absence) is
recorded, and retrying that record through a database blip.

The send path never holds a transaction across the HTTP call:
claim (commit) -> attempt row (commit) -> request -> outcome and new state (commit).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.utils.module_loading import import_string

from outbox import botapi, circuits, policy, ratelimit, transitions
from outbox.dispatch import dispatch, kick_chat
from outbox.methods import CREATES_MESSAGE
from outbox.models import ErrorClass, OnAmbiguous, OutboundMessage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendResult:
    """What happened to a send, and when (if at all) the task should run again."""

    status: str
    countdown: float | None = None
    slot_reserved: bool = False


def limited_chat_id(message: OutboundMessage) -> int | None:
    """The chat whose flood limit this send counts against: None for calls that put no new
    message in a chat (edits, deletions, callback answers)."""
    return message.chat_id if message.method in CREATES_MESSAGE else None


def _relevance_veto(message: OutboundMessage) -> str:
    path = settings.DOVECOTE_RELEVANCE_CHECK
    if not path:
        return ""
    check = import_string(path)
    return check(message) or ""


EXPIRED_REASON = "expired: not sent before expires_at"


def cancel_reason(message: OutboundMessage, *, now: datetime) -> tuple[str, str] | None:
    """Why a claimed message must be cancelled rather than sent: (reason, error class) when
    it expired or the relevance check vetoes it, else None."""
    if message.expires_at and message.expires_at <= now:
        return EXPIRED_REASON, ErrorClass.EXPIRED
    veto = _relevance_veto(message)
    if veto:
        return f"not relevant: {veto}", "vetoed"
    return None


T = TypeVar("T")
# Telegram has answered; writing its answer down is worth a few tries through a database
# blip (a failover, a restarted pooler) before the send is left to the sweeper, which can
# then only call it `unknown`. Together well inside checks.RECORD_MARGIN_SECONDS.
OUTCOME_WRITE_RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0)


def with_outcome_write_retries(write: Callable[[], T], *, message_ids: list[int]) -> T:
    """Run `write` (recording outcomes: conditional transitions, safe to repeat), retrying
    on a lost database connection. The last failure propagates: the lease then runs out and
    the sweeper makes the sends `unknown`."""
    for delay in OUTCOME_WRITE_RETRY_DELAYS:
        try:
            return write()
        except (OperationalError, InterfaceError) as exc:
            logger.warning("recording the outcome of messages %s failed (%s); retrying in %ss", message_ids, exc, delay)
            connection.close()  # the next query opens a new connection
            time.sleep(delay)
    return write()


# Refusals that come from Telegram itself, with a working token (not 401, not a 5xx or a
# lost connection): for the bot's circuit they count as the destination being healthy.
ANSWERED_BY_TELEGRAM = frozenset({ErrorClass.PERMANENT, ErrorClass.MIGRATED, ErrorClass.RATE_LIMITED})


def record_outcome(message: OutboundMessage, *, worker: str, attempt: Any, outcome: botapi.CallOutcome) -> SendResult:
    """Decide and record what Telegram's answer (or its absence) means for a claimed message:
    sent, retry, dead letter, unknown, a circuit opened. The single send and the drain both
    record through here, so a failure is decided the same way on either path."""
    if outcome.ok:
        # The chat's next message comes back with the outcome's statement: no query of
        # its own, and none at all for unordered messages (broadcasts).
        done = transitions.mark_sent([(message, attempt, outcome)], worker=worker, next_in_chat=message.ordered)
        if message.pk not in done and transitions.settle_late_success(message, attempt=attempt, outcome=outcome):
            logger.warning("message %s: success arrived after its lease ran out; settled as sent", message.pk)
            return SendResult("sent-late")
        if getattr(message, "circuit_dirty", True):
            circuits.record_success(circuits.bot_scope(message.bot_id))
        next_in_chat = done.get(message.pk)
        if next_in_chat is not None and next_in_chat != message.pk:
            dispatch(next_in_chat, bot_id=message.bot_id)
        return SendResult("sent")

    cls = outcome.error_class
    logger.info("send of message %s failed: %s (%s)", message.pk, cls, outcome.description, extra={"error_class": cls})
    if cls in ANSWERED_BY_TELEGRAM and getattr(message, "circuit_dirty", True):
        # Telegram answered and accepted the token, only not this request: the bot is
        # reachable, so a half-open probe succeeded and counted failures are forgotten.
        circuits.record_success(circuits.bot_scope(message.bot_id))
    if cls == ErrorClass.RATE_LIMITED:
        # Telegram's retry_after is a floor, never shortened; flood control is per bot.
        wait = max(outcome.retry_after or 1.0, 0.0)
        ratelimit.pause_bot(message.bot_id, wait)
        free = message.rate_limited_count < policy.FREE_RATE_LIMITED_ATTEMPTS
        if not free and message.attempts >= message.max_attempts:
            transitions.dead_letter(
                message, worker=worker, attempt=attempt, outcome=outcome, reason_class=ErrorClass.EXHAUSTED
            )
            kick_chat(message)
            return SendResult("dead-lettered")
        transitions.schedule_retry(message, worker=worker, attempt=attempt, outcome=outcome, delay=wait, free=free)
        return SendResult("retry", wait)
    if cls == ErrorClass.MIGRATED and outcome.migrate_to_chat_id:
        already_migrated = message.attempt_set.filter(outcome=ErrorClass.MIGRATED).exclude(pk=attempt.pk).exists()
        if already_migrated:
            transitions.dead_letter(message, worker=worker, attempt=attempt, outcome=outcome)
            kick_chat(message)
            return SendResult("dead-lettered")
        transitions.schedule_retry(
            message,
            worker=worker,
            attempt=attempt,
            outcome=outcome,
            delay=0,
            free=True,
            chat_id=outcome.migrate_to_chat_id,
        )
        # The rest of this chat's queue follows it to the supergroup.
        transitions.migrate_chat(
            bot_id=message.bot_id, old_chat_id=message.chat_id, new_chat_id=outcome.migrate_to_chat_id
        )
        return SendResult("retry", 0)
    if cls == ErrorClass.AUTH:
        delay = circuits.open_for_auth(circuits.bot_scope(message.bot_id), reason=outcome.description)
        transitions.schedule_retry(message, worker=worker, attempt=attempt, outcome=outcome, delay=delay, free=True)
        return SendResult("circuit-opened", None)
    if cls == ErrorClass.AMBIGUOUS:
        transitions.mark_unknown(message, worker=worker, attempt=attempt, outcome=outcome)
        kick_chat(message)
        if message.on_ambiguous == OnAmbiguous.RESEND:
            # Reconciliation resends it (with the same key) and records the decision.
            return SendResult("unknown-resend")
        return SendResult("unknown")
    if cls == ErrorClass.TRANSIENT:
        circuits.record_failure(circuits.bot_scope(message.bot_id), reason=outcome.description)
        if message.attempts >= message.max_attempts:
            transitions.dead_letter(
                message, worker=worker, attempt=attempt, outcome=outcome, reason_class=ErrorClass.EXHAUSTED
            )
            kick_chat(message)
            return SendResult("dead-lettered")
        delay = policy.backoff_seconds(message.attempts)
        transitions.schedule_retry(message, worker=worker, attempt=attempt, outcome=outcome, delay=delay)
        return SendResult("retry", delay)
    # Permanent: no point retrying; an operator sees it at once.
    transitions.dead_letter(message, worker=worker, attempt=attempt, outcome=outcome)
    kick_chat(message)
    return SendResult("dead-lettered")
