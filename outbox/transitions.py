"""Every state change of an outbound message, each one conditional UPDATE.

pending|retry -> sending (claim) -> sent | retry | failed | unknown;
(new) -> sending (write_claimed: a message written by the worker that sends it);
pending|retry -> cancelled; sending with an expired lease -> retry or unknown (sweeper).

A function returns False (or None) when the row was not in the expected state: another
worker got there first, or an operator changed it meanwhile. A stale worker can never
overwrite a newer state because every UPDATE names the state and the lease it expects.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone

from core import metrics
from core import rows as rows_module
from outbox import chat_order, circuits, selectors, sql
from outbox.botapi import CallOutcome
from outbox.methods import keeps_full_result
from outbox.models import (
    ATTEMPT_OK,
    WAITING_STATES,
    Attempt,
    DeadLetter,
    DeadLetterStatus,
    ErrorClass,
    OutboundMessage,
    State,
)
from outbox.signals import message_ambiguous, message_dead_lettered, message_delivered_late

WAITING = list(WAITING_STATES)

# The send path's transitions (claim, claim_batch, write_claimed, begin_attempts, mark_sent)
# are one hand-written statement each (outbox/sql.py): conditional UPDATEs without the ORM's
# query building, which cost more CPU than the database did (docs/PERFORMANCE.md).


def claim(message_id: int, *, worker: str, lease: timedelta, unchanged_since: datetime | None = None) -> bool:
    """pending|retry -> sending. False when another worker got there first or it is not due;
    with `unchanged_since`, also False when the row was updated after that time."""
    now = timezone.now()
    params: list[Any] = [worker, now + lease, now, message_id, now]
    if unchanged_since is None:
        return rows_module.execute(sql.CLAIM, params) == 1
    return rows_module.execute(sql.CLAIM_UNCHANGED, [*params, unchanged_since]) == 1


# The batched drain (outbox/sending/batch.py): the same transitions, for many messages of one bot
# per statement (FOR UPDATE SKIP LOCKED).


def claim_batch(
    *,
    bot_id: int,
    worker: str,
    lease: timedelta,
    limit: int,
    due_since: datetime | None = None,
    ids: list[int] | None = None,
    bulk: bool = False,
) -> list[OutboundMessage]:
    """pending|retry -> sending for up to `limit` of the bot's due messages, oldest due first,
    in one statement, skipping rows another worker holds (SKIP LOCKED), ordered messages with an
    earlier one open in their chat, and everything while the bot's circuit is not closed.
    `bulk`: the broadcast lane only (else none of it). `due_since`: only messages due since then.
    `ids`: only those. Committed asynchronously (core/rows.py): the attempt row's commit, before
    any request, waits for the disk and so for this claim too."""

    now = timezone.now()
    since = due_since or datetime.min.replace(tzinfo=now.tzinfo)
    scope = circuits.bot_scope(bot_id)
    params = [bot_id, now, since, *([ids] if ids is not None else []), now, scope]
    params += [limit, worker, now + lease, now, scope]
    messages = []
    statement = sql.claim_batch(bulk=bulk, by_ids=ids is not None)
    for *values, circuit_dirty in rows_module.fetch(statement, params, async_commit=True):
        message = sql.message(values)
        # The bot's circuit is closed (else nothing is claimed); with failures counted, a
        # success must reset them.
        message.circuit_dirty = circuit_dirty
        messages.append(message)
    messages.sort(key=lambda m: (m.next_attempt_at, m.pk))
    return messages


def write_claimed(message: OutboundMessage, *, worker: str, lease: timedelta) -> bool | None:
    """(new) -> sending, or -> as given: write the message once per key, born claimed by
    `worker` when `claim_batch` would claim it at once, in the one statement that writes it (for
    a worker that sends what it writes). None: the key was taken, nothing written. True: written
    claimed (state, lease and `circuit_dirty` set on `message`). False: written pending, for the
    drain. Committed asynchronously, as a claim: a row PostgreSQL loses takes its run's done mark
    with it, and the run writes it again."""
    return write_many_claimed([message], worker=worker, lease=lease)[0]


def write_many_claimed(messages: list[OutboundMessage], *, worker: str, lease: timedelta) -> list[bool | None]:
    """`write_claimed` for several messages of one bot in one statement, in order (ids follow
    the list). An ordered message after another ordered one of its chat in the list is
    written pending: the earlier is still open when this statement decides (it cannot see
    its own rows), so a claim would have skipped it too."""
    if not messages:
        return []
    now = timezone.now()
    seen: set[int] = set()
    first_in_chat = []
    for message in messages:
        first_in_chat.append(not message.ordered or message.chat_id not in seen)
        if message.ordered:
            seen.add(message.chat_id)
    written = rows_module.insert_many_computed(
        messages,
        unique=("bot_id", "idempotency_key"),
        computed=sql.WRITTEN_CLAIMED,
        lateral=sql.WRITTEN_CLAIMED_GOES,
        returning=sql.WRITTEN_CLAIMED_RETURNING,
        before=chat_order.write_lock(messages),
        params={
            "now": now,
            "scope": circuits.bot_scope(messages[0].bot_id),
            "worker": worker,
            "until": now + lease,
            "first_in_chat": first_in_chat,
        },
        async_commit=True,
    )
    outcomes: list[bool | None] = []
    for message, found in zip(messages, written, strict=True):
        if found is None:
            outcomes.append(None)
            continue
        _, claimed, circuit_dirty = found
        if claimed:
            message.state, message.lease_owner, message.lease_expires_at = State.SENDING, worker, now + lease
            message.circuit_dirty = circuit_dirty
        outcomes.append(bool(claimed))
    return outcomes


def begin_attempts(messages: list[OutboundMessage], *, worker: str) -> dict[int, Attempt]:
    """Record the attempts before the requests go out: each claimed message's attempt count
    and attempt row, in one statement (one commit). Messages whose lease was
    lost get none. The single send passes a list of one."""
    if not messages:
        return {}
    now = timezone.now()
    rows = rows_module.fetch(sql.BEGIN_ATTEMPTS, [now, [m.pk for m in messages], worker, worker, now])
    by_id = {m.pk: m for m in messages}
    attempts: dict[int, Attempt] = {}
    for attempt_id, message_id, number in rows:
        message = by_id[message_id]
        message.attempts = number
        attempt = rows_module.new(Attempt, id=attempt_id, message=message, number=number, worker=worker, started_at=now)
        attempt._state.adding = False
        attempts[message_id] = attempt
    return attempts


def mark_sent(
    sent: list[tuple[OutboundMessage, Attempt, CallOutcome]], *, worker: str, next_in_chat: bool = False
) -> dict[int, int | None]:
    """sending -> sent, with Telegram's message ids, for the messages this worker still holds
    (one whose lease was lost meanwhile is left to whoever holds it now), in one statement.
    Returns {id of each message that became sent: None, or with `next_in_chat`
    its chat's next due message (looked up after the mark commits: selectors.
    next_open_messages_in_chats), for the
    caller to dispatch}.
    The single send passes a list of one; the drain a batch."""
    if not sent:
        return {}
    now = timezone.now()
    message_ids, attempt_ids, telegram_ids, results = [], [], [], []
    for message, attempt, outcome in sent:
        message_ids.append(message.pk)
        attempt_ids.append(attempt.pk)
        telegram_ids.append(outcome.telegram_message_id)
        results.append(json.dumps(outcome.result) if _keeps_result(message, outcome) else None)
    rows = rows_module.fetch(
        sql.MARK_SENT,
        [message_ids, attempt_ids, telegram_ids, results, now, attempt_ids, now, now, message_ids, worker],
    )
    done: dict[int, int | None] = dict.fromkeys((message_id for message_id, *_ in rows), None)
    if next_in_chat and rows:
        done.update(selectors.next_open_messages_in_chats([(m, b, c) for m, b, c, _ in rows]))
    # Update received -> reply sent, read in the same statement.
    metrics.observe_reply_seconds((now - received).total_seconds() for *_, received in rows if received)
    for message, _, _ in sent:
        if message.pk in done:
            message.state = State.SENT
    return done


def finish_attempt(attempt: Attempt, outcome: CallOutcome) -> None:
    Attempt.objects.filter(pk=attempt.pk).update(
        finished_at=timezone.now(),
        outcome=ATTEMPT_OK if outcome.ok else outcome.error_class,
        http_status=outcome.http_status,
        error_code=outcome.error_code,
        description=outcome.description[:2000],
        retry_after=outcome.retry_after,
    )


def _keeps_result(message: OutboundMessage, outcome: CallOutcome) -> bool:
    """Telegram's answer is kept when it is not a message (its id says all of a message), or
    when the message's writer replays the whole answer (methods.keeps_full_result)."""
    return not outcome.telegram_message_id or keeps_full_result(message.idempotency_key)


def _sent_fields(outcome: CallOutcome, now: datetime, *, whole: bool = False) -> dict[str, Any]:
    """A message's columns once it is sent (a late success; mark_sent's statement sets the same)."""
    telegram_message_id = outcome.telegram_message_id
    return {
        "state": State.SENT,
        "sent_at": now,
        "updated_at": now,
        "telegram_message_id": telegram_message_id,
        "result": outcome.result if whole or not telegram_message_id else None,
        "lease_owner": "",
        "lease_expires_at": None,
        "last_error": "",
        "last_error_class": "",
    }


def _owned(message: OutboundMessage, worker: str) -> Any:
    return OutboundMessage.objects.filter(pk=message.pk, state=State.SENDING, lease_owner=worker)


def settle_late_success(message: OutboundMessage, *, attempt: Attempt, outcome: CallOutcome) -> bool:
    """unknown (or retry/sending after a resend decision, before its new attempt) -> sent:
    Telegram answered this attempt with success after the worker's lease had run out and the
    sweeper had given the send up. The answer settles it: the message is sent, its case is
    closed as delivered (`message_delivered_late`) and the resend, if one was decided, finds
    nothing to send. Only while no later attempt has started (`attempts` is still this
    attempt's number): a later attempt is its own send."""
    now = timezone.now()
    with transaction.atomic():
        n = OutboundMessage.objects.filter(
            pk=message.pk, state__in=[State.UNKNOWN, State.RETRY, State.SENDING], attempts=attempt.number
        ).update(**_sent_fields(outcome, now, whole=_keeps_result(message, outcome)))
        if n != 1:
            return False
        message.state = State.SENT
        message_delivered_late.send(sender=OutboundMessage, message=message, attempt_number=attempt.number)
    return True


def schedule_retry(
    message: OutboundMessage,
    *,
    worker: str,
    attempt: Attempt | None,
    outcome: CallOutcome,
    delay: float,
    free: bool = False,
    chat_id: int | None = None,
) -> bool:
    """sending -> retry at now + delay. `free` attempts (429 within the cap, auth pauses)
    do not spend the retry budget."""
    now = timezone.now()
    fields: dict[str, Any] = {
        "state": State.RETRY,
        "next_attempt_at": now + timedelta(seconds=delay),
        "updated_at": now,
        "lease_owner": "",
        "lease_expires_at": None,
        "last_error": outcome.description[:2000],
        "last_error_class": outcome.error_class,
    }
    if free:
        fields["max_attempts"] = F("max_attempts") + 1
    if outcome.error_class == ErrorClass.RATE_LIMITED:
        fields["rate_limited_count"] = F("rate_limited_count") + 1
    if chat_id is not None:
        fields["chat_id"] = chat_id
    with transaction.atomic():
        if attempt is not None:
            finish_attempt(attempt, outcome)
        n = _owned(message, worker).update(**fields)
    if n == 1:
        metrics.RETRIES.labels(reason=outcome.error_class or "unknown").inc()
    return n == 1


def release(message: OutboundMessage, *, worker: str, next_attempt_at: datetime) -> bool:
    """sending -> pending without an attempt (the send was deferred before any request)."""
    n = _owned(message, worker).update(
        state=State.PENDING if message.attempts == 0 else State.RETRY,
        next_attempt_at=next_attempt_at,
        lease_owner="",
        lease_expires_at=None,
        updated_at=timezone.now(),
    )
    return n == 1


def make_due(message_id: int, *, now: datetime) -> bool:
    """pending|retry -> the same, due now (the sweeper's redispatch)."""
    return OutboundMessage.objects.filter(pk=message_id, state__in=WAITING).update(next_attempt_at=now) == 1


def make_outage_retries_due(bot_id: int, *, now: datetime) -> tuple[int, int]:
    """retry -> retry, due again when first due (its send_at, else when written), for the
    bot's messages whose last attempt the outage failed (a transient error, an auth refusal):
    its circuit just closed, so their backoff no longer stands for anything. Due now, they
    would queue behind everything written before the close (the drain takes the oldest due
    first), their chats' later messages with them. Never before a message's send_at.
    Returns how many replies and how many broadcast messages were moved."""
    from django.db.models import Q
    from django.db.models.functions import Coalesce

    first_due = Greatest("created_at", Coalesce("send_at", "created_at"))
    outage = (
        OutboundMessage.objects.filter(
            bot_id=bot_id, state=State.RETRY, last_error_class__in=[ErrorClass.TRANSIENT, ErrorClass.AUTH]
        )
        .filter(Q(send_at__isnull=True) | Q(send_at__lte=now))
        .filter(next_attempt_at__gt=first_due)
    )
    replies = outage.filter(broadcast="").update(next_attempt_at=first_due)
    return replies, outage.exclude(broadcast="").update(next_attempt_at=first_due)


def defer(message_id: int, *, until: datetime) -> bool:
    """pending|retry stays waiting, due later (a rate-limit wait beyond a short countdown):
    the row, not the broker, holds long waits, so the sweeper does not redispatch early."""
    n = OutboundMessage.objects.filter(pk=message_id, state__in=WAITING, next_attempt_at__lt=until).update(
        next_attempt_at=until, updated_at=timezone.now()
    )
    return n == 1


def migrate_chat(*, bot_id: int, old_chat_id: int, new_chat_id: int) -> int:
    """The group became a supergroup: waiting messages to the old chat follow it."""
    return OutboundMessage.objects.filter(bot_id=bot_id, chat_id=old_chat_id, state__in=WAITING).update(
        chat_id=new_chat_id, updated_at=timezone.now()
    )


def dead_letter(
    message: OutboundMessage,
    *,
    worker: str | None,
    attempt: Attempt | None,
    outcome: CallOutcome,
    reason_class: str | None = None,
) -> DeadLetter | None:
    """sending (or, with worker=None, pending|retry) -> failed, with a dead-letter record."""
    now = timezone.now()
    with transaction.atomic():
        if attempt is not None:
            finish_attempt(attempt, outcome)
        rows = _owned(message, worker) if worker else OutboundMessage.objects.filter(pk=message.pk, state__in=WAITING)
        n = rows.update(
            state=State.FAILED,
            updated_at=now,
            lease_owner="",
            lease_expires_at=None,
            last_error=outcome.description[:2000],
            last_error_class=reason_class or outcome.error_class,
        )
        if n != 1:
            return None
        first = (
            Attempt.objects.filter(message=message, outcome__in=[c.value for c in ErrorClass])
            .order_by("number")
            .values_list("description", flat=True)
            .first()
        )
        letter = DeadLetter.objects.create(
            bot_id=message.bot_id,
            message=message,
            consumer=message.consumer,
            reason_class=reason_class or outcome.error_class,
            first_error=(first or outcome.description)[:2000],
            last_error=outcome.description[:2000],
            trace_id=message.trace_id,
            chat_id=message.chat_id,
            idempotency_key=message.idempotency_key,
        )
        message.state = State.FAILED
        message_dead_lettered.send(sender=OutboundMessage, message=message, dead_letter=letter)
    metrics.DEAD_LETTERS.labels(kind="message", reason=letter.reason_class).inc()
    return letter


def mark_unknown(
    message: OutboundMessage, *, worker: str | None, attempt: Attempt | None, outcome: CallOutcome
) -> bool:
    """sending -> unknown: the request may have reached Telegram. Opens a reconciliation
    case through `message_ambiguous`; never resent automatically unless on_ambiguous=resend."""
    with transaction.atomic():
        if attempt is not None:
            finish_attempt(attempt, outcome)
        rows = _owned(message, worker) if worker else OutboundMessage.objects.filter(pk=message.pk, state=State.SENDING)
        return _to_unknown(rows, message, description=outcome.description)


def _to_unknown(rows: Any, message: OutboundMessage, *, description: str) -> bool:
    """The `unknown` step of `mark_unknown` and `_unknown_instead`: `rows` (the message, in
    the state it must still be in) -> unknown, and its case opened through
    `message_ambiguous`. Call inside a transaction."""
    now = timezone.now()
    n = rows.update(
        state=State.UNKNOWN,
        updated_at=now,
        lease_owner="",
        lease_expires_at=None,
        last_error=description[:2000],
        last_error_class=ErrorClass.AMBIGUOUS,
    )
    if n != 1:
        return False
    message.state = State.UNKNOWN
    facts = {"attempts": message.attempts, "last_error": description[:500], "at": now.isoformat()}
    message_ambiguous.send(sender=OutboundMessage, message=message, facts=facts)
    return True


def replace_failed_payload(message_id: int, payload: dict[str, Any]) -> bool:
    """failed -> failed with an operator's corrected payload (edit and retry). The send path
    re-reads the row after its claim, so the correction is what goes out."""
    n = OutboundMessage.objects.filter(pk=message_id, state=State.FAILED).update(
        payload=payload, updated_at=timezone.now()
    )
    return n == 1


def assign_dead_letter(letter_id: int, *, owner: Any) -> bool:
    """Name the user who owns a dead letter's triage (None clears it)."""
    return DeadLetter.objects.filter(pk=letter_id).update(owner=owner) == 1


def close_dead_letter(letter_id: int, *, status: str, note: str) -> bool:
    """A dead letter open -> requeued | resolved | discarded, with the operator's note."""
    n = DeadLetter.objects.filter(pk=letter_id, status=DeadLetterStatus.OPEN).update(
        status=status, resolution_note=note[:2000], resolved_at=timezone.now()
    )
    return n == 1


def cancel(message_id: int, *, reason: str, error_class: str = "") -> bool:
    """pending|retry -> cancelled. False when it is already sending, sent or final.

    Expired or vetoed after an attempt whose outcome nobody knows (an `on_ambiguous=resend`
    message resent with its key), the message may well be in the chat: it becomes unknown
    with a case instead (`_unknown_instead`), never `cancelled`."""
    if error_class in _SYSTEM_CANCELS and _maybe_delivered(message_id):
        rows = OutboundMessage.objects.filter(pk=message_id, state__in=WAITING)
        message = rows.first()
        return message is not None and _unknown_instead(message, rows, reason=reason)
    n = OutboundMessage.objects.filter(pk=message_id, state__in=WAITING).update(
        state=State.CANCELLED, cancel_reason=reason[:2000], last_error_class=error_class, updated_at=timezone.now()
    )
    return n == 1


# Cancels the outbox decides on its own (not an operator's or a client's): an expired message,
# one the relevance check vetoes.
_SYSTEM_CANCELS = frozenset({ErrorClass.EXPIRED, "vetoed"})


def _maybe_delivered(message_id: int) -> bool:
    """An earlier attempt of this message may have reached the chat (its outcome is unknown)."""
    return Attempt.objects.filter(message_id=message_id, outcome=ErrorClass.AMBIGUOUS).exists()


def _unknown_instead(message: OutboundMessage, rows: Any, *, reason: str) -> bool:
    """-> unknown, with a reconciliation case, for a message that is ending unsent while an
    earlier attempt may have delivered it: cancelled would say it is not in the chat."""
    why = f"{reason}, after an attempt whose outcome is unknown: it may be in the chat; not sent again"
    with transaction.atomic():
        return _to_unknown(rows, message, description=why)


def cancel_broadcast_batch(*, bot_id: int, broadcast: str, reason: str, batch: int = 5000) -> list[int]:
    """pending|retry -> cancelled for up to `batch` waiting messages of one broadcast; the ids
    cancelled. Found through the partial due index (waiting rows only), never a scan of the
    sent ones; a message already claimed (sending) is left to finish."""
    ids = list(
        OutboundMessage.objects.filter(bot_id=bot_id, broadcast=broadcast, state__in=WAITING)
        .order_by("pk")
        .values_list("pk", flat=True)[:batch]
    )
    if not ids:
        return []
    with transaction.atomic():
        done = list(
            OutboundMessage.objects.select_for_update()
            .filter(pk__in=ids, state__in=WAITING)
            .order_by("pk")  # locked in one order: two cancels of one broadcast must not deadlock
            .values_list("pk", flat=True)
        )
        OutboundMessage.objects.filter(pk__in=done).update(
            state=State.CANCELLED, cancel_reason=reason[:2000], last_error_class="", updated_at=timezone.now()
        )
    return done


def cancel_claimed(message: OutboundMessage, *, worker: str, reason: str, error_class: str = "") -> bool:
    """sending -> cancelled before any request (expired, or vetoed by the relevance check);
    unknown instead after an attempt whose outcome nobody knows (see `cancel`)."""
    if error_class in _SYSTEM_CANCELS and _maybe_delivered(message.pk):
        return _unknown_instead(message, _owned(message, worker), reason=reason)
    n = _owned(message, worker).update(
        state=State.CANCELLED,
        cancel_reason=reason[:2000],
        last_error_class=error_class,
        lease_owner="",
        lease_expires_at=None,
        updated_at=timezone.now(),
    )
    return n == 1


def recover_expired_lease(
    message_id: int, *, worker: str | None = None, claimed_before: datetime | None = None
) -> str | None:
    """A worker died holding the send. With no request started (no open attempt) the
    message goes back to retry; with an open attempt nobody knows: unknown. With `worker`
    and `claimed_before`: that worker's claim from before then, whatever its lease (the
    worker itself, whose task holding it failed with an outage: reconciliation/resume.py)."""
    now = timezone.now()
    with transaction.atomic():
        # Locked, so the worker (if it is only slow) cannot record its answer underneath us.
        rows = OutboundMessage.objects.select_for_update().filter(pk=message_id, state=State.SENDING)
        if worker is not None and claimed_before is not None:
            rows = rows.filter(lease_owner=worker, updated_at__lt=claimed_before)
        else:
            rows = rows.filter(lease_expires_at__lt=now)
        message = rows.first()
        if message is None:
            return None
        open_attempt = Attempt.objects.filter(
            message=message, number=message.attempts, finished_at__isnull=True
        ).first()
        if open_attempt is None:
            OutboundMessage.objects.filter(pk=message.pk).update(
                state=State.PENDING if message.attempts == 0 else State.RETRY,
                next_attempt_at=now,
                lease_owner="",
                lease_expires_at=None,
                updated_at=now,
                # An operator (and the fault schedules) can tell why it waited.
                last_error=f"released: worker {message.lease_owner or '?'} lost its claim before any request"
                if worker is None
                else f"taken up again by worker {worker} after an outage, before any request",
            )
            return "released"
        outcome = CallOutcome(
            ok=False,
            error_class=ErrorClass.AMBIGUOUS,
            description=f"worker {message.lease_owner or '?'} died or lost the answer after the request started",
        )
        mark_unknown(message, worker=None, attempt=open_attempt, outcome=outcome)
    return "unknown"


def reset_for_resend(message_id: int, *, from_states: list[str]) -> bool:
    """unknown|failed -> retry with the same key (an operator's decision, or policy)."""
    now = timezone.now()
    n = OutboundMessage.objects.filter(pk=message_id, state__in=from_states).update(
        state=State.RETRY,
        next_attempt_at=now,
        # A resend of an exhausted message needs room for one more attempt.
        max_attempts=Greatest(F("max_attempts"), F("attempts") + 1),
        updated_at=now,
    )
    return n == 1


def mark_delivered_by_decision(message_id: int, *, telegram_message_id: int | None = None) -> bool:
    """unknown -> sent: an operator established that Telegram got it (reconciliation)."""
    now = timezone.now()
    n = OutboundMessage.objects.filter(pk=message_id, state=State.UNKNOWN).update(
        state=State.SENT,
        sent_at=now,
        telegram_message_id=telegram_message_id,
        lease_owner="",
        lease_expires_at=None,
        updated_at=now,
    )
    return n == 1


def cancel_unknown(message_id: int, *, reason: str) -> bool:
    """unknown -> cancelled: an operator decided not to resend (it may or may not have arrived)."""
    n = OutboundMessage.objects.filter(pk=message_id, state=State.UNKNOWN).update(
        state=State.CANCELLED, cancel_reason=reason[:2000], updated_at=timezone.now()
    )
    return n == 1
