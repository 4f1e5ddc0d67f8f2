"""Operators' triage of dead letters: retry (one, edited, in bulk, recover since), resolve,
discard, assign; pause and resume bots and consumers. Every action writes an AuditEntry.

A retry never mints a new key: it puts the same outbox message (or consumer run) back in
the queue. Before that it looks the stored idempotency key up - in the outbox and in the
effect ledger - and refuses when the effect already happened; then it re-checks the
current state (cancelled, expired, handled by hand, relevance hook) and skips stale work.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max, QuerySet
from django.utils import timezone
from django.utils.module_loading import import_string

from bots import registry
from bots import transitions as bot_transitions
from bots.models import ConsumerRun, RunState
from bots.runs import dispatch_run
from core.publishing import publish
from outbox import circuits
from outbox import services as outbox_services
from outbox import transitions as outbox_transitions
from outbox.models import DeadLetter, DeadLetterStatus, Effect, EffectState, OutboundMessage, State
from reconciliation import transitions as reconciliation_transitions
from reconciliation.models import BulkRetry, BulkState, PayloadVersion
from reconciliation.services import audit_record

logger = logging.getLogger(__name__)

REQUEUED = "requeued"
REFUSED = "refused"
SKIPPED = "skipped"


class TriageError(ValueError):
    """The operator's request cannot be carried out as given (missing reason, bad payload)."""


@dataclass(frozen=True)
class RetryResult:
    """What a retry did: requeued, refused (the effect already happened) or skipped (stale,
    handled by hand, changed meanwhile), and why in the operator's words."""

    outcome: str
    reason: str

    @property
    def requeued(self) -> bool:
        return self.outcome == REQUEUED

    def __str__(self) -> str:
        return f"{self.outcome}: {self.reason}"


def _target(letter: DeadLetter) -> str:
    return f"outbox.DeadLetter:{letter.pk}"


def _require(text: str, what: str) -> str:
    text = (text or "").strip()
    if not text:
        raise TriageError(f"{what} is required")
    return text


def effect_prefix(run: ConsumerRun) -> str:
    """The ledger keys of a consumer run's effects start with this (see ConsumerContext.effect_key)."""
    return f"eff:{run.bot_id}:{run.update.update_id}:{run.consumer}:"


# --- the checks -------------------------------------------------------------------------


def _check_message(letter: DeadLetter, message: OutboundMessage) -> RetryResult | None:
    """The stored key first (refuse if it is done), then the current state (skip if stale)."""
    if message.state == State.SENT:
        return RetryResult(
            REFUSED,
            f"already delivered: message {message.pk} was sent (Telegram message id {message.telegram_message_id})",
        )
    # Keys are unique per bot, not across bots: another bot's message with this key is
    # another message.
    newer = (
        OutboundMessage.objects.filter(bot_id=message.bot_id, idempotency_key=letter.idempotency_key, state=State.SENT)
        .exclude(pk=message.pk)
        .first()
    )
    if newer is not None:
        return RetryResult(REFUSED, f"already delivered: message {newer.pk} with the same key was sent")
    effect = Effect.objects.filter(key=letter.idempotency_key).first()
    if effect is not None and effect.state == EffectState.DONE:
        return RetryResult(REFUSED, f"the effect ledger shows key {effect.key} done")
    if message.state == State.CANCELLED:
        return RetryResult(SKIPPED, f"cancelled: {message.cancel_reason or 'no reason given'}")
    if message.state == State.UNKNOWN:
        return RetryResult(SKIPPED, "the outcome is unknown: decide its reconciliation case instead")
    if message.state != State.FAILED:
        return RetryResult(SKIPPED, f"the message is {message.state} now, not failed")
    if message.expires_at and message.expires_at <= timezone.now():
        return RetryResult(SKIPPED, f"expired at {message.expires_at:%Y-%m-%d %H:%M:%S %Z}")
    if settings.DOVECOTE_RELEVANCE_CHECK:
        veto = import_string(settings.DOVECOTE_RELEVANCE_CHECK)(message)
        if veto:
            return RetryResult(SKIPPED, f"no longer relevant: {veto}")
    return None


def _check_run(run: ConsumerRun) -> RetryResult | None:
    if run.state == RunState.DONE:
        return RetryResult(REFUSED, "the consumer run has completed since")
    effects = list(Effect.objects.filter(key__startswith=effect_prefix(run)).order_by("key"))
    unknown = [e.key for e in effects if e.state in (EffectState.UNKNOWN, EffectState.STARTED)]
    if unknown:
        return RetryResult(REFUSED, f"effect {unknown[0]} may have applied: decide its reconciliation case")
    if effects and all(e.state == EffectState.DONE for e in effects):
        return RetryResult(REFUSED, f"the effect ledger shows its effects done ({', '.join(e.key for e in effects)})")
    if run.state == RunState.CANCELLED:
        return RetryResult(SKIPPED, f"cancelled: {run.cancel_reason or 'no reason given'}")
    if run.state != RunState.FAILED:
        return RetryResult(SKIPPED, f"the run is {run.state} now, not failed")
    spec = registry.get(run.consumer)
    if spec is None:
        return RetryResult(SKIPPED, f"no consumer named {run.consumer!r} is registered")
    if run.update.received_at < timezone.now() - spec.max_age:
        return RetryResult(SKIPPED, f"expired: the update is older than the consumer's max age ({spec.max_age})")
    return None


def dead_letter_check(letter: DeadLetter) -> RetryResult | None:
    """Why this dead letter must not be retried now, or None when it may be."""
    if letter.status in (DeadLetterStatus.RESOLVED, DeadLetterStatus.DISCARDED):
        by = f" by {letter.owner}" if letter.owner_id else ""
        return RetryResult(SKIPPED, f"handled by hand: {letter.status}{by}: {letter.resolution_note or '-'}")
    if letter.status == DeadLetterStatus.REQUEUED:
        return RetryResult(SKIPPED, "already requeued")
    if letter.message_id:
        return _check_message(letter, OutboundMessage.objects.get(pk=letter.message_id))
    return _check_run(ConsumerRun.objects.select_related("update").get(pk=letter.consumer_run_id))


# --- retry ------------------------------------------------------------------------------


def _save_correction(message: OutboundMessage, *, user: Any, reason: str, payload: dict[str, Any]) -> PayloadVersion:
    """Keep the original as version 1 (once), add the correction as the next version."""
    try:
        # The outbox's own validation, so a correction cannot smuggle in what enqueue refuses.
        outbox_services.validate_call(message.method, message.chat_id, payload)
    except outbox_services.MessageRejected as exc:
        raise TriageError(f"the corrected payload is refused: {exc}") from exc
    if not message.payload_versions.exists():
        PayloadVersion.objects.create(message=message, number=1, payload=message.payload, reason="original")
    number = (message.payload_versions.aggregate(n=Max("number"))["n"] or 0) + 1
    version = PayloadVersion.objects.create(
        message=message, number=number, payload=payload, author=_user(user), reason=reason
    )
    outbox_transitions.replace_failed_payload(message.pk, payload)
    return version


def _user(user: Any) -> Any:
    return user if getattr(user, "pk", None) else None


def dead_letter_retry(
    letter: DeadLetter,
    user: Any,
    reason: str,
    corrected_payload: dict[str, Any] | None = None,
    *,
    bulk: BulkRetry | None = None,
) -> RetryResult:
    """Requeue a dead letter's message or run with the same key, after the checks."""
    reason = _require(reason, "a reason")
    if corrected_payload is not None and not letter.message_id:
        raise TriageError("only an outbound message's payload can be corrected")
    if corrected_payload is not None and not isinstance(corrected_payload, dict):
        raise TriageError("the corrected payload must be a JSON object")
    details: dict[str, Any] = {"idempotency_key": letter.idempotency_key}
    if bulk is not None:
        details["bulk_retry"] = bulk.pk
    with transaction.atomic():
        letter = DeadLetter.objects.select_for_update().get(pk=letter.pk)
        result = dead_letter_check(letter)
        if result is None:
            result = _requeue(letter, user=user, reason=reason, corrected_payload=corrected_payload, details=details)
        audit_record(
            actor=user,
            action="deadletter.bulk_retry_item" if bulk else "deadletter.retry",
            target=_target(letter),
            reason=reason,
            outcome=str(result),
            details=details,
        )
    return result


def _requeue(
    letter: DeadLetter, *, user: Any, reason: str, corrected_payload: dict[str, Any] | None, details: dict[str, Any]
) -> RetryResult:
    if letter.message_id:
        message = OutboundMessage.objects.get(pk=letter.message_id)
        if corrected_payload is not None:
            version = _save_correction(message, user=user, reason=reason, payload=corrected_payload)
            details["payload_version"] = version.number
        if not outbox_services.outbound_message_resend(message.pk, from_states=[State.FAILED]):
            return RetryResult(SKIPPED, "the message changed meanwhile")
        what = f"message {message.pk} queued again with key {message.idempotency_key}"
    else:
        run_id = letter.consumer_run_id
        if not bot_transitions.reset_run_for_retry(run_id, from_states=[RunState.FAILED]):
            return RetryResult(SKIPPED, "the run changed meanwhile")
        transaction.on_commit(lambda: dispatch_run(run_id))
        what = f"consumer run {run_id} ({letter.consumer}) queued again with key {letter.idempotency_key}"
    outbox_transitions.close_dead_letter(
        letter.pk, status=DeadLetterStatus.REQUEUED, note=f"requeued by {user or 'system'}: {reason}"
    )
    return RetryResult(REQUEUED, what)


# --- resolve, discard, assign -----------------------------------------------------------


def _close(letter: DeadLetter, *, user: Any, status: str, note: str, action: str) -> bool:
    with transaction.atomic():
        closed = outbox_transitions.close_dead_letter(letter.pk, status=status, note=note)
        audit_record(
            actor=user,
            action=action,
            target=_target(letter),
            reason=note,
            outcome=status if closed else "not open: nothing changed",
            details={"idempotency_key": letter.idempotency_key},
        )
    return closed


def dead_letter_resolve(letter: DeadLetter, user: Any, note: str) -> bool:
    """open -> resolved (handled by hand). False when it was not open."""
    return _close(
        letter, user=user, status=DeadLetterStatus.RESOLVED, note=_require(note, "a note"), action="deadletter.resolve"
    )


def dead_letter_discard(letter: DeadLetter, user: Any, reason: str) -> bool:
    """open -> discarded (not worth doing). False when it was not open."""
    return _close(
        letter,
        user=user,
        status=DeadLetterStatus.DISCARDED,
        note=_require(reason, "a reason"),
        action="deadletter.discard",
    )


def dead_letter_assign(letter: DeadLetter, user: Any, owner: Any) -> None:
    """Name the person who owns this dead letter (None clears it)."""
    with transaction.atomic():
        previous = DeadLetter.objects.filter(pk=letter.pk).values_list("owner__username", flat=True).first()
        outbox_transitions.assign_dead_letter(letter.pk, owner=_user(owner))
        audit_record(
            actor=user,
            action="deadletter.assign",
            target=_target(letter),
            outcome=f"owner {previous or '-'} -> {owner or '-'}",
        )


# --- bulk retry -------------------------------------------------------------------------


def _ids(letters: QuerySet | Iterable[int]) -> list[int]:
    if isinstance(letters, QuerySet):
        return list(letters.order_by("pk").values_list("pk", flat=True))
    return sorted({int(pk) for pk in letters})


def bulk_retry_start(letters: QuerySet | Iterable[int], user: Any, reason: str, *, scope: str = "") -> BulkRetry:
    """Plan a bulk retry and start releasing it from the bulk queue after commit.

    The oldest go first (keeps each chat's order). A small first batch, then doubling per
    tick, capped at the slowest selected bot's rate limit per tick."""
    reason = _require(reason, "a reason")
    ids = _ids(letters)
    rates = DeadLetter.objects.filter(pk__in=ids).values_list("bot__rate_limit", flat=True).distinct()
    tick = float(settings.DOVECOTE_BULK_TICK_SECONDS)
    first = int(settings.DOVECOTE_BULK_FIRST_BATCH)
    cap = max(1, int(min(rates, default=settings.DOVECOTE_DEFAULT_RATE_LIMIT) * tick))
    with transaction.atomic():
        bulk = BulkRetry.objects.create(
            created_by=_user(user),
            reason=reason,
            scope=scope[:300],
            item_ids=ids,
            total=len(ids),
            first_batch=min(first, cap),
            max_batch=cap,
            tick_seconds=tick,
            state=BulkState.RUNNING if ids else BulkState.DONE,
            ticked_at=timezone.now(),
            finished_at=None if ids else timezone.now(),
        )
        audit_record(
            actor=user,
            action="deadletter.bulk_retry",
            target=f"reconciliation.BulkRetry:{bulk.pk}",
            reason=reason,
            outcome=f"planned {len(ids)} items: first batch {bulk.first_batch}, at most {cap} per {tick:g}s",
            details={"scope": scope, "items": len(ids)},
        )
        if ids:
            transaction.on_commit(lambda: bulk_retry_schedule(bulk.pk))
    return bulk


def bulk_retry_schedule(bulk_id: int, *, countdown: float = 0.0) -> bool:
    """Publish the next tick on the bulk queue (never the fresh-traffic queue), for the
    release cursor as it stands: of two ticks for the same cursor only the first releases."""
    from reconciliation.triage_tasks import bulk_retry_tick as task

    released = BulkRetry.objects.filter(pk=bulk_id).values_list("released", flat=True).first()
    # Broker down: logged by publish(); the sweeper resumes the bulk retry later.
    return publish(
        task.signature(queue=settings.CELERY_TASK_QUEUE_BULK),
        (bulk_id,),
        {"released": released},
        countdown=countdown,
        what=f"bulk retry {bulk_id}",
    )


def bulk_retry_tick(bulk_id: int, *, expect_released: int | None = None) -> float | None:
    """Release the next batch. Returns the seconds until the next tick, or None when done
    or cancelled. The row is locked for the batch, so a redelivered tick cannot double it;
    with `expect_released`, a tick whose cursor has moved on (a second chain of ticks, from
    the sweeper's resume or an operator's "continue") stops rather than doubling the pace."""
    with transaction.atomic():
        bulk = BulkRetry.objects.select_for_update().filter(pk=bulk_id).first()
        if bulk is None or bulk.state != BulkState.RUNNING:
            return None
        if expect_released is not None and bulk.released != expect_released:
            return None
        size = min(bulk.first_batch * 2 ** len(bulk.batches), bulk.max_batch)
        batch = bulk.item_ids[bulk.released : bulk.released + size]
        reasons = dict(bulk.reasons)
        counts = {REQUEUED: 0, REFUSED: 0, SKIPPED: 0}
        letters = DeadLetter.objects.in_bulk(batch)
        for pk in batch:
            letter = letters.get(pk)
            result = (
                RetryResult(SKIPPED, "the dead letter no longer exists")
                if letter is None
                else dead_letter_retry(letter, bulk.created_by, bulk.reason, bulk=bulk)
            )
            counts[result.outcome] += 1
            if not result.requeued:
                key = f"{result.outcome}: {_reason_bucket(result.reason)}"
                reasons[key] = reasons.get(key, 0) + 1
        bulk.released += len(batch)
        bulk.requeued += counts[REQUEUED]
        bulk.refused += counts[REFUSED]
        bulk.skipped += counts[SKIPPED]
        bulk.batches = [*bulk.batches, len(batch)]
        bulk.reasons = reasons
        bulk.ticked_at = timezone.now()
        done = bulk.released >= bulk.total
        reconciliation_transitions.record_bulk_progress(bulk, done=done)
        if done:
            audit_record(
                actor=bulk.created_by,
                action="deadletter.bulk_retry_done",
                target=f"reconciliation.BulkRetry:{bulk.pk}",
                reason=bulk.reason,
                outcome=bulk_summary(bulk),
                details={"reasons": reasons, "batches": bulk.batches},
            )
    return None if done else bulk.tick_seconds


def _reason_bucket(reason: str) -> str:
    # Group "already delivered: message 17 ..." and "... message 18 ..." under one line.
    return reason.split(":", 1)[0]


def bulk_summary(bulk: BulkRetry) -> str:
    return (
        f"{bulk.requeued} requeued, {bulk.refused} refused (already done), {bulk.skipped} skipped (stale or "
        f"handled); {bulk.released} of {bulk.total} checked"
    )


def bulk_retry_cancel(bulk: BulkRetry, user: Any, reason: str = "") -> bool:
    """running -> cancelled: the rest of the plan is not released. Items already requeued stay requeued."""
    with transaction.atomic():
        cancelled = reconciliation_transitions.cancel_bulk_retry(bulk.pk, user=_user(user))
        bulk.refresh_from_db()
        audit_record(
            actor=user,
            action="deadletter.bulk_retry_cancel",
            target=f"reconciliation.BulkRetry:{bulk.pk}",
            reason=reason,
            outcome=("cancelled; " if cancelled else "not running; ") + bulk_summary(bulk),
        )
    return cancelled


def recover_since(
    *,
    user: Any,
    reason: str,
    since: datetime,
    reason_class: str,
    bot_id: int | None = None,
    consumer: str = "",
) -> BulkRetry:
    """After an outage is fixed: requeue every open dead letter of one reason since a time,
    for a bot and/or a consumer, through the same checked, batched bulk path."""
    if bot_id is None and not consumer:
        raise TriageError("choose a bot or a consumer")
    letters = DeadLetter.objects.filter(status=DeadLetterStatus.OPEN, reason_class=reason_class, created_at__gte=since)
    parts = [f"reason={reason_class}", f"since={since.isoformat()}"]
    if bot_id is not None:
        letters = letters.filter(bot_id=bot_id)
        parts.append(f"bot={bot_id}")
    if consumer:
        letters = letters.filter(consumer=consumer)
        parts.append(f"consumer={consumer}")
    return bulk_retry_start(letters, user, reason, scope="recover since: " + " ".join(parts))


# --- pause / resume ---------------------------------------------------------------------


def circuit_pause(scope: str, user: Any, reason: str) -> None:
    """Open a bot's or a consumer's circuit by hand: work waits, nothing is lost."""
    reason = _require(reason, "a reason")
    circuits.pause(scope, reason=f"paused by {user}: {reason}")
    audit_record(actor=user, action="circuit.pause", target=scope, reason=reason, outcome="paused")


def circuit_resume(scope: str, user: Any, reason: str = "") -> None:
    circuits.resume(scope)
    audit_record(actor=user, action="circuit.resume", target=scope, reason=reason, outcome="resumed")
