"""Outbox services: enqueue a message, send it, cancel it, resend it.

The send path never holds a transaction across the HTTP call:
claim (commit) -> attempt row (commit) -> request -> outcome and new state (commit).
A redelivered task is harmless because the send starts with `claim()`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from outbox import botapi, circuits, policy, ratelimit, retention, selectors, splitting, transitions
from outbox.failpoints import failpoint, uncommitted
from outbox.logs import current_trace_id
from outbox.models import ErrorClass, OnAmbiguous, OutboundMessage, State
from outbox.publishing import publish

logger = logging.getLogger(__name__)


def worker_id() -> str:
    # Recomputed after fork: prefork children must not share their parent's id.
    return f"{socket.gethostname()}:{os.getpid()}"


class MessageRejected(ValueError):
    """The message cannot be accepted as given (bad method, chat or payload). `field` names
    the offending input, for the API's field errors."""

    def __init__(self, message: str, *, field: str = "payload") -> None:
        super().__init__(message)
        self.field = field


SUPPORTED_METHODS = frozenset(
    {
        "sendMessage",
        "sendPhoto",
        "sendDocument",
        "sendVideo",
        "sendAudio",
        "sendVoice",
        "sendAnimation",
        "sendSticker",
        "sendLocation",
        "sendContact",
        "sendPoll",
        "sendDice",
        "sendChatAction",
        "sendMediaGroup",
        "editMessageText",
        "editMessageCaption",
        "editMessageReplyMarkup",
        "deleteMessage",
        "answerCallbackQuery",
        "copyMessage",
        "forwardMessage",
        "pinChatMessage",
        "unpinChatMessage",
    }
)
# Calls that are not messages: they need not wait behind a chat's messages (a callback
# answer expires within seconds, a typing indicator announces the reply queued after it),
# so they are unordered by default, and they take no slot of the chat's message limit.
NOT_A_MESSAGE = frozenset({"sendChatAction", "answerCallbackQuery"})
# Methods that put a new message in a chat, and so count against the flood limits.
CREATES_MESSAGE = frozenset(
    m for m in SUPPORTED_METHODS if m.startswith(("send", "copy", "forward")) and m not in NOT_A_MESSAGE
)


def ordered_by_default(method: str) -> bool:
    """Whether a call waits for the earlier messages of its chat unless told otherwise."""
    return method not in NOT_A_MESSAGE


def limited_chat_id(message: OutboundMessage) -> int | None:
    """The chat whose flood limit this send counts against: None for calls that put no new
    message in a chat (edits, deletions, callback answers)."""
    return message.chat_id if message.method in CREATES_MESSAGE else None


def validate_call(method: str, chat_id: Any, payload: Any, *, splittable: bool = False) -> None:
    """Refuse what Telegram certainly would (lengths as Telegram counts them: UTF-16 units
    after entity parsing). `splittable`: an over-long sendMessage is split by the caller."""
    if method not in SUPPORTED_METHODS:
        raise MessageRejected(f"unsupported Bot API method {method!r}", field="method")
    if isinstance(chat_id, bool) or not isinstance(chat_id, int):
        raise MessageRejected("chat_id must be an integer", field="chat_id")
    if not -(2**63) <= chat_id < 2**63:
        raise MessageRejected("chat_id is out of range", field="chat_id")
    if not isinstance(payload, dict):
        raise MessageRejected("payload must be a JSON object")
    if "chat_id" in payload:
        raise MessageRejected("give chat_id once, outside payload")
    if method in ("sendMessage", "editMessageText"):
        text = payload.get("text")
        if not isinstance(text, str) or not text.strip():
            raise MessageRejected(f"{method} needs a non-empty text")
        if method == "editMessageText":
            why = "an edit cannot be split into several messages"
            _check_length(text, payload.get("parse_mode"), limit=splitting.TEXT_LIMIT, what="text", why=why)
        elif not splittable:
            why = "only a single message (outbound_message_enqueue) is split into parts"
            _check_length(text, payload.get("parse_mode"), limit=splitting.TEXT_LIMIT, what="text", why=why)
    if method == "sendMediaGroup":
        _check_media_group(payload.get("media"))
    _check_captions(method, payload)


def _check_media_group(media: Any) -> None:
    types = ", ".join(botapi.INPUT_MEDIA_TYPES)
    if not isinstance(media, list) or not 2 <= len(media) <= 10:
        raise MessageRejected("sendMediaGroup needs `media`: a list of 2-10 items", field="payload")
    for n, item in enumerate(media, start=1):
        if not isinstance(item, dict) or item.get("type") not in botapi.INPUT_MEDIA_TYPES:
            raise MessageRejected(f"media item {n} needs a type: {types}", field="payload")
        if not isinstance(item.get("media"), str) or not item["media"]:
            raise MessageRejected(f"media item {n} needs `media`: a file id or a URL", field="payload")


def _check_length(text: str, parse_mode: Any, *, limit: int, what: str, why: str) -> None:
    length = splitting.visible_length(text, parse_mode if isinstance(parse_mode, str) else None)
    if length > limit:
        raise MessageRejected(f"the {what} is {length} UTF-16 units long; Telegram allows {limit} and {why}")


def _check_captions(method: str, payload: dict[str, Any]) -> None:
    items = [payload]
    if method == "sendMediaGroup" and isinstance(payload.get("media"), list):
        items += [item for item in payload["media"] if isinstance(item, dict)]
    for item in items:
        caption = item.get("caption")
        if isinstance(caption, str):
            why = "a caption cannot be split"
            _check_length(caption, item.get("parse_mode"), limit=splitting.CAPTION_LIMIT, what="caption", why=why)


def _parts(method: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The payloads to store for one enqueue: one, or the parts of an over-long sendMessage."""
    if method != "sendMessage":
        return [payload]
    try:
        return splitting.split_message_payload(payload)
    except splitting.CannotSplit as exc:
        raise MessageRejected(f"the text is too long for one message: {exc}") from exc


def idempotency_key_problem(key: str) -> str:
    """Why a key cannot be used ("" when it can): 1-255 characters, none of them a control
    character (PostgreSQL's text refuses NUL; the others are invisible in the admin)."""
    if not 1 <= len(key) <= 255:
        return "an idempotency key is 1-255 characters"
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        return "an idempotency key has no control characters"
    return ""


def _validate_options(
    *, idempotency_key: str, send_at: datetime | None, expires_at: datetime | None, on_ambiguous: str
) -> None:
    problem = idempotency_key_problem(idempotency_key)
    if problem:
        raise MessageRejected(problem, field="idempotency_key")
    if on_ambiguous not in OnAmbiguous.values:
        raise MessageRejected(f"on_ambiguous is one of {', '.join(OnAmbiguous.values)}", field="on_ambiguous")
    if send_at and expires_at and expires_at <= send_at:
        raise MessageRejected("expires_at must be after send_at", field="expires_at")


def outbound_message_enqueue(
    *,
    bot_id: int,
    chat_id: int,
    payload: dict[str, Any],
    idempotency_key: str,
    method: str = "sendMessage",
    trace_id: str = "",
    source_update_id: int | None = None,
    consumer: str = "",
    user_id: int | None = None,
    send_at: datetime | None = None,
    expires_at: datetime | None = None,
    on_ambiguous: str = OnAmbiguous.HOLD,
    ordered: bool | None = None,
    max_attempts: int | None = None,
) -> tuple[OutboundMessage, bool]:
    """Write a message to the outbox (once per key) and dispatch it after commit.

    Returns (message, created). The same key returns the stored message untouched.

    A sendMessage longer than Telegram allows (4,096 UTF-16 units after entity parsing) is
    split (outbox/splitting.py) into ordered messages written in one transaction: the first
    keeps `idempotency_key` and is the one returned, part n gets `splitting.part_key(key, n)`.
    The same key again finds the first part and creates nothing.

    `ordered`: wait for the earlier messages of the chat; None means yes for messages and
    no for calls that are not messages (`NOT_A_MESSAGE`).
    """
    validate_call(method, chat_id, payload, splittable=True)
    _validate_options(
        idempotency_key=idempotency_key, send_at=send_at, expires_at=expires_at, on_ambiguous=on_ambiguous
    )
    payloads = _parts(method, payload)
    now = timezone.now()
    defaults = {
        "chat_id": chat_id,
        "method": method,
        "payload": payloads[0],
        "trace_id": trace_id or current_trace_id.get(),
        "source_update_id": source_update_id,
        "consumer": consumer,
        "user_id": user_id,
        "send_at": send_at,
        "expires_at": expires_at,
        "on_ambiguous": on_ambiguous,
        # The parts of one text go in order whatever the caller asked for.
        "ordered": (ordered_by_default(method) if ordered is None else ordered) or len(payloads) > 1,
        "max_attempts": max_attempts or settings.DOVECOTE_OUTBOX_MAX_ATTEMPTS,
        "next_attempt_at": max(send_at, now) if send_at else now,
    }
    messages: list[OutboundMessage] = []
    try:
        with transaction.atomic():
            message, created = OutboundMessage.objects.get_or_create(
                bot_id=bot_id, idempotency_key=idempotency_key, defaults=defaults
            )
            messages.append(message)
            if created:
                # Inserted one by one, so that ids - the chat's send order - follow the text.
                messages += [
                    OutboundMessage.objects.create(
                        bot_id=bot_id,
                        idempotency_key=splitting.part_key(idempotency_key, n),
                        **(defaults | {"payload": p}),
                    )
                    for n, p in enumerate(payloads[1:], start=2)
                ]
    except IntegrityError:
        # A concurrent insert with the same key won the race.
        first = OutboundMessage.objects.filter(bot_id=bot_id, idempotency_key=idempotency_key).first()
        if first is None:
            # Not the first key: a part's key belongs to another message.
            raise MessageRejected(
                f"the keys of this message's parts ({idempotency_key}#2, ...) are taken by other messages",
                field="idempotency_key",
            ) from None
        return first, False
    if created:
        delay = max(0.0, (message.next_attempt_at - now).total_seconds())

        def dispatch_all() -> None:
            for row in messages:
                dispatch(row.pk, bot_id=row.bot_id, countdown=delay)

        transaction.on_commit(dispatch_all)
    return message, created


def dispatch(
    message_id: int,
    *,
    bot_id: int | None = None,
    countdown: float = 0.0,
    slot_reserved: bool = False,
    bulk: bool = False,
) -> bool:
    """Hand a message to a worker. Failure to publish is logged, never raised: the row is
    committed and the sweeper dispatches whatever is overdue. `bulk` (broadcasts) uses the
    bulk queue, so that replies to people are not stuck behind thousands of notifications.

    Given its `bot_id`, a message due now wakes the bot's batched drain (outbox/drain.py)
    instead of getting a task of its own; a wait, a reserved slot or a broadcast keeps the
    one-message task."""
    if countdown > policy.MAX_BROKER_COUNTDOWN_SECONDS:
        return False  # the sweeper picks it up when due
    if bot_id is not None and countdown <= 0 and not slot_reserved and not bulk:
        from outbox import drain

        if drain.enabled():
            return drain.wake(bot_id)
    from outbox.tasks import send_outbound_message

    kwargs: dict[str, Any] = {"slot_reserved": True} if slot_reserved else {}
    task: Any = send_outbound_message
    if bulk:
        kwargs["bulk"] = True
        task = send_outbound_message.signature(queue=settings.CELERY_TASK_QUEUE_BULK)
    return publish(task, (message_id,), kwargs, countdown=countdown, what=f"message {message_id}")


@dataclass(frozen=True)
class SendResult:
    """What happened to a send, and when (if at all) the task should run again."""

    status: str
    countdown: float | None = None
    slot_reserved: bool = False


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


# A deferral longer than this is also written to the row (next_attempt_at), so the sweeper
# does not take the message for lost and dispatch it a second time meanwhile.
DEFER_IN_ROW_AFTER_SECONDS = 5.0


def outbound_message_send(message_id: int, *, slot_reserved: bool = False) -> SendResult:
    """Send one outbound message, at most once per claim. Safe to call any number of times.

    `slot_reserved`: this call comes back at a rate-limit slot reserved for it earlier.
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
            _kick_chat(message)
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
    )
    if wait.seconds > 0:
        # Waiting for a slot is not an attempt and does not hold a worker.
        if wait.beyond_horizon or wait.seconds > DEFER_IN_ROW_AFTER_SECONDS:
            transitions.defer(message.pk, until=now + timedelta(seconds=wait.seconds))
        if wait.beyond_horizon:
            return SendResult("rate-limited")  # the sweeper dispatches it when due
        return SendResult("rate-limited", wait.seconds, slot_reserved=wait.slot_reserved)

    lease = timedelta(seconds=settings.DOVECOTE_SEND_LEASE_SECONDS)
    # The claim also checks that nobody changed the row since it was read (updated_at), so
    # the row in hand is what gets sent; otherwise claim as usual and read it again.
    if not _claim(message.pk, worker=worker, lease=lease, unchanged_since=message.updated_at):
        if not _claim(message.pk, worker=worker, lease=lease):
            return SendResult("claimed-elsewhere")
        failpoint("after_claim")
        message = OutboundMessage.objects.select_related("bot").get(pk=message.pk)
    else:
        failpoint("after_claim")
        message.state, message.lease_owner = State.SENDING, worker

    stop = cancel_reason(message, now=now)  # expiry was checked before the claim: a veto
    if stop:
        transitions.cancel_claimed(message, worker=worker, reason=stop[0], error_class=stop[1])
        _kick_chat(message)
        return SendResult("vetoed")

    attempt = transitions.begin_attempt(message, worker=worker)
    if attempt is None:
        return SendResult("lease-lost")
    failpoint("before_request")
    outcome = botapi.call(
        token=message.bot.token,
        base_url=message.bot.api_base_url,
        method=message.method,
        params={"chat_id": message.chat_id, **message.payload},
        bot_name=message.bot.name,
    )
    failpoint("after_response")
    result = with_outcome_write_retries(
        lambda: record_outcome(message, worker=worker, attempt=attempt, outcome=outcome), message_ids=[message.pk]
    )
    failpoint("after_record")
    return result


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


def _claim(message_id: int, *, worker: str, lease: timedelta, unchanged_since: datetime | None = None) -> bool:
    with uncommitted("before_claim_commit"):
        claimed = transitions.claim(message_id, worker=worker, lease=lease, unchanged_since=unchanged_since)
        if claimed:
            failpoint("before_claim_commit")
    return claimed


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
        sent = transitions.mark_sent(
            message, worker=worker, attempt=attempt, outcome=outcome, kick_chat=message.ordered
        )
        if not sent and transitions.settle_late_success(message, attempt=attempt, outcome=outcome):
            logger.warning("message %s: success arrived after its lease ran out; settled as sent", message.pk)
            return SendResult("sent-late")
        if getattr(message, "circuit_dirty", True):
            circuits.record_success(circuits.bot_scope(message.bot_id))
        if sent.next_in_chat is not None and sent.next_in_chat != message.pk:
            dispatch(sent.next_in_chat, bot_id=message.bot_id)
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
            _kick_chat(message)
            return SendResult("dead-lettered")
        transitions.schedule_retry(message, worker=worker, attempt=attempt, outcome=outcome, delay=wait, free=free)
        return SendResult("retry", wait)
    if cls == ErrorClass.MIGRATED and outcome.migrate_to_chat_id:
        already_migrated = message.attempt_set.filter(outcome=ErrorClass.MIGRATED).exclude(pk=attempt.pk).exists()
        if already_migrated:
            transitions.dead_letter(message, worker=worker, attempt=attempt, outcome=outcome)
            _kick_chat(message)
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
        _kick_chat(message)
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
            _kick_chat(message)
            return SendResult("dead-lettered")
        delay = policy.backoff_seconds(message.attempts)
        transitions.schedule_retry(message, worker=worker, attempt=attempt, outcome=outcome, delay=delay)
        return SendResult("retry", delay)
    # Permanent: no point retrying; an operator sees it at once.
    transitions.dead_letter(message, worker=worker, attempt=attempt, outcome=outcome)
    _kick_chat(message)
    return SendResult("dead-lettered")


def _kick_chat(message: OutboundMessage) -> None:
    """The chat's queue moved on: hand the next ordered message of this chat to a worker.
    Only ordered messages hold a chat up, so an unordered one (broadcasts) kicks nobody."""
    if not message.ordered:
        return
    next_id = selectors.next_open_message_in_chat(bot_id=message.bot_id, chat_id=message.chat_id)
    if next_id is not None and next_id != message.pk:
        dispatch(next_id, bot_id=message.bot_id)


def outbound_message_cancel(message_id: int, *, reason: str = "cancelled") -> bool:
    """Cancel a message that has not gone out. False when it is sending or already final.

    The first part of a split text takes its other parts with it (those still waiting):
    the rest of an answer whose beginning was cancelled must not go out on its own."""
    message = OutboundMessage.objects.filter(pk=message_id).first()
    if message is None:
        return False
    ok = transitions.cancel(message_id, reason=reason)
    if ok:
        for part_id in selectors.outbound_message_part_ids(message)[1:]:
            transitions.cancel(part_id, reason=f"{reason} (with the first part of its text)")
        _kick_chat(message)
    return ok


def outbound_broadcast_cancel(*, bot_id: int, broadcast: str, reason: str = "cancelled") -> int:
    """Cancel every message of a broadcast that is still waiting (pending or retry), in
    batches; messages already sent or being sent are left as they are. How many were cancelled."""
    if not broadcast:
        raise ValueError("a broadcast key is required")
    total = 0
    while True:
        ids = transitions.cancel_broadcast_batch(bot_id=bot_id, broadcast=broadcast, reason=reason)
        if not ids:
            return total
        total += len(ids)
        # Broadcasts are unordered and hold no chat up; an ordered one (rare) lets its chat move on.
        for message in OutboundMessage.objects.filter(pk__in=ids, ordered=True):
            _kick_chat(message)


def outbound_message_resend(message_id: int, *, from_states: list[str]) -> bool:
    """Put a failed or unknown message back in the queue with the same key, and dispatch it."""
    ok = transitions.reset_for_resend(message_id, from_states=from_states)
    if ok:
        transaction.on_commit(lambda: dispatch(message_id))
    return ok


def api_client_add(*, name: str, bot_names: list[str], payload_access: bool = False) -> tuple[Any, str, bool]:
    """Create or update a REST API client: a user named `name` (no password, not staff) with a
    token, allowed to use exactly these bots. Returns (client, token, created). Raises
    ValueError naming an unknown bot or an unusable name."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from outbox.models import ApiClient

    if not 1 <= len(name) <= 150:
        raise ValueError("a client name is 1-150 characters")
    bots = list(selectors.bot_model().objects.filter(name__in=bot_names))
    unknown = sorted(set(bot_names) - {bot.name for bot in bots})
    if unknown:
        raise ValueError(f"unknown bot(s): {', '.join(unknown)}")
    with transaction.atomic():
        user, created = get_user_model().objects.get_or_create(username=name)
        if created:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        client, _ = ApiClient.objects.update_or_create(user=user, defaults={"payload_access": payload_access})
        client.bots.set(bots)
        token, _ = Token.objects.get_or_create(user=user)
    return client, token.key, created


@dataclass(frozen=True)
class BroadcastResult:
    message_ids: list[int]
    created: int


def client_key(*, client: str, key: str) -> str:
    """An outbox key for a key chosen by an API client: clients never collide with each
    other or with the project's own keys, and the result fits in 255 characters."""
    derived = f"api:{client}:{key}"
    if len(derived) <= 255:
        return derived
    return f"api:{client}:sha256:{hashlib.sha256(key.encode()).hexdigest()}"


def broadcast_message_key(broadcast_key: str, chat_id: int) -> str:
    """The outbox key of one chat's message in a broadcast: stable, at most 255 characters."""
    key = f"bc:{broadcast_key}:{chat_id}"
    if len(key) <= 255:
        return key
    digest = hashlib.sha256(broadcast_key.encode()).hexdigest()
    return f"bc:sha256:{digest}:{chat_id}"


def broadcast_enqueue(
    *,
    bot_id: int,
    chat_ids: list[int],
    payload: dict[str, Any],
    broadcast_key: str,
    method: str = "sendMessage",
    send_at: datetime | None = None,
    expires_at: datetime | None = None,
    on_ambiguous: str = OnAmbiguous.HOLD,
    trace_id: str = "",
) -> BroadcastResult:
    """One payload to many chats: one unordered outbox message per chat, keyed by the
    broadcast key and the chat, drained within the bot's rate limits on the bulk queue.

    Calling it again with the same key creates nothing new and dispatches nothing again.
    """
    if not chat_ids:
        raise MessageRejected("chat_ids must not be empty", field="chat_ids")
    unique_chats = list(dict.fromkeys(chat_ids))
    for chat_id in unique_chats:
        validate_call(method, chat_id, payload)
    _validate_options(idempotency_key=broadcast_key, send_at=send_at, expires_at=expires_at, on_ambiguous=on_ambiguous)
    now = timezone.now()
    keys = {broadcast_message_key(broadcast_key, chat_id): chat_id for chat_id in unique_chats}
    with transaction.atomic():
        existing = set(
            OutboundMessage.objects.filter(bot_id=bot_id, idempotency_key__in=list(keys)).values_list(
                "idempotency_key", flat=True
            )
        )
        rows = [
            OutboundMessage(
                bot_id=bot_id,
                chat_id=chat_id,
                method=method,
                payload=payload,
                idempotency_key=key,
                broadcast=broadcast_key,
                trace_id=trace_id or current_trace_id.get(),
                send_at=send_at,
                expires_at=expires_at,
                on_ambiguous=on_ambiguous,
                ordered=False,
                max_attempts=settings.DOVECOTE_OUTBOX_MAX_ATTEMPTS,
                next_attempt_at=max(send_at, now) if send_at else now,
            )
            for key, chat_id in keys.items()
            if key not in existing
        ]
        slots = _broadcast_slots(bot_id=bot_id, method=method, send_at=send_at, n=len(rows))
        reserved_at = time.monotonic()
        for row, delay in zip(rows, slots, strict=False):
            # Due at its slot, in the row too (as a deferred send's is), so that the sweeper
            # does not take it for lost meanwhile.
            row.next_attempt_at = now + timedelta(seconds=delay)
        # A concurrent call with the same key may insert some first: theirs stand.
        OutboundMessage.objects.bulk_create(rows, batch_size=1000, ignore_conflicts=True)
        ids = dict(
            OutboundMessage.objects.filter(bot_id=bot_id, idempotency_key__in=list(keys)).values_list(
                "idempotency_key", "id"
            )
        )
        new_ids = [ids[row.idempotency_key] for row in rows if row.idempotency_key in ids]
        reserved = {
            ids[row.idempotency_key]: d for row, d in zip(rows, slots, strict=False) if row.idempotency_key in ids
        }
        delay = max(0.0, (send_at - now).total_seconds()) if send_at else 0.0

        def publish_all() -> None:
            for pk in new_ids:
                if pk in reserved:
                    # Counted from the reservation, not from this publish: publishing
                    # thousands takes seconds, which would stretch the slots apart.
                    countdown = max(0.0, reserved[pk] - (time.monotonic() - reserved_at))
                    dispatch(pk, countdown=countdown, slot_reserved=True, bulk=True)
                else:
                    dispatch(pk, countdown=delay, bulk=True)

        transaction.on_commit(publish_all)
    return BroadcastResult(message_ids=[ids[k] for k in keys if k in ids], created=len(rows))


def _broadcast_slots(*, bot_id: int, method: str, send_at: datetime | None, n: int) -> list[float]:
    """Rate-limit slots for a broadcast due now, reserved in one go: each message is then
    dispatched once, for its slot, rather than once to ask for a slot and again to send
    (which queued thousands of slot requests ahead of the sends; docs/PERFORMANCE.md).
    Messages past the horizon get none and take the usual path; so do all of them when
    Redis is unreachable."""
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED or method not in CREATES_MESSAGE or send_at or n == 0:
        return []
    rate = selectors.bot_model().objects.filter(pk=bot_id).values_list("rate_limit", flat=True).first()
    if not rate:
        return []
    import redis

    try:
        return ratelimit.reserve_slots(bot_id, rate, n, horizon=policy.MAX_BROKER_COUNTDOWN_SECONDS)
    except redis.RedisError as exc:
        # The broadcast is stored all the same: without slots its messages stay due in their
        # rows, and the sweeper hands them to the drain once Redis answers again.
        logger.warning("broadcast of bot %s stored without rate-limit slots: Redis unreachable: %s", bot_id, exc)
        return []


def outbound_messages_purge_payloads(*, older_than: datetime | None = None, batch_size: int = 500) -> int:
    """Blank the text, markup and captions of messages sent before `older_than` (default:
    DOVECOTE_PAYLOAD_RETENTION_DAYS ago). Metadata - chat, method, states, attempts, keys,
    Telegram's message id - stays. Returns how many messages were purged. The sweeper purges
    in budgeted batches instead (outbox/retention.py)."""
    if older_than is None:
        older_than = timezone.now() - timedelta(days=settings.DOVECOTE_PAYLOAD_RETENTION_DAYS)
    purged = 0
    while n := retention.outbound_payloads_purge_batch(older_than, size=batch_size):
        purged += n
    return purged
