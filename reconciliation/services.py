"""Decisions on ambiguous outcomes, and the audit log.

A reconciliation case is closed only by a decision: an operator's (mark delivered, resend
with the same key, cancel) or the message's own `on_ambiguous=resend` policy (auto_resend,
recorded as "a duplicate is possible"). Nothing turns an ambiguous outcome into success or
failure by itself. Each decision records who, why and when, and writes an AuditEntry.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F, Q

from outbox import effects
from outbox import services as outbox_services
from outbox import transitions as outbox_transitions
from outbox.models import EffectState, OutboundMessage, State
from reconciliation import transitions
from reconciliation.models import AuditEntry, CaseStatus, Decision, ReconciliationCase


class CaseNotOpen(Exception):
    """The case was decided already (by another operator, or by policy)."""


class CaseSubjectChanged(Exception):
    """The message or effect is no longer in the ambiguous state the case describes."""


def audit_record(
    *, actor: Any, action: str, target: str, reason: str = "", outcome: str = "", details: dict[str, Any] | None = None
) -> AuditEntry:
    return AuditEntry.objects.create(
        actor=actor if getattr(actor, "pk", None) else None,
        action=action,
        target=target[:200],
        reason=reason,
        outcome=outcome,
        details=details or {},
    )


def _target(case: ReconciliationCase) -> str:
    if case.message_id:
        return f"outbox.OutboundMessage:{case.message_id}"
    return f"outbox.Effect:{case.effect_id}"


def _lock_open(case: ReconciliationCase) -> ReconciliationCase:
    locked = ReconciliationCase.objects.select_for_update().filter(pk=case.pk).first()
    if locked is None or locked.status != CaseStatus.OPEN:
        raise CaseNotOpen(f"case {case.pk} is not open")
    return locked


def _decide(case: ReconciliationCase, *, user: Any, decision: str, reason: str, outcome: str, details: dict) -> None:
    transitions.resolve_case(case.pk, decision=decision, user=user, reason=reason)
    audit_record(
        actor=user,
        action=f"reconciliation.{decision}",
        target=_target(case),
        reason=reason,
        outcome=outcome,
        details={"case": case.pk, "idempotency_key": case.idempotency_key, **details},
    )
    case.refresh_from_db()


def case_mark_delivered(
    case: ReconciliationCase, user: Any, reason: str, telegram_message_id: int | None = None
) -> ReconciliationCase:
    """The operator established that the request arrived: unknown -> sent (or effect done)."""
    with transaction.atomic():
        case = _lock_open(case)
        if case.message_id:
            if not outbox_transitions.mark_delivered_by_decision(
                case.message_id, telegram_message_id=telegram_message_id
            ):
                raise CaseSubjectChanged(f"message {case.message_id} is no longer unknown")
        elif not effects.effect_mark_done(
            case.effect.key,
            result={"marked_done_by_operator": True},
            external_id=str(telegram_message_id or ""),
            from_states=(EffectState.UNKNOWN, EffectState.STARTED),
        ):
            raise CaseSubjectChanged(f"effect {case.effect_id} is no longer unknown")
        _decide(
            case,
            user=user,
            decision=Decision.MARK_DELIVERED,
            reason=reason,
            outcome="marked delivered",
            details={"telegram_message_id": telegram_message_id},
        )
    return case


def case_resend(case: ReconciliationCase, user: Any, reason: str) -> ReconciliationCase:
    """Send again with the same idempotency key (a duplicate is possible, the operator
    accepted that). For an effect: it becomes `failed`, so its next run may repeat it."""
    with transaction.atomic():
        case = _lock_open(case)
        if case.message_id:
            if not outbox_services.outbound_message_resend(case.message_id, from_states=[State.UNKNOWN]):
                raise CaseSubjectChanged(f"message {case.message_id} is no longer unknown")
        elif not effects.effect_mark_not_applied(
            case.effect.key,
            reason=f"operator decided to repeat: {reason}",
            from_states=(EffectState.UNKNOWN, EffectState.STARTED),
        ):
            raise CaseSubjectChanged(f"effect {case.effect_id} is no longer unknown")
        _decide(
            case,
            user=user,
            decision=Decision.RESEND,
            reason=reason,
            outcome="queued again with the same key",
            details={},
        )
    return case


def case_cancel(case: ReconciliationCase, user: Any, reason: str) -> ReconciliationCase:
    """Do not send again: unknown -> cancelled. An effect stays unknown and is never repeated."""
    with transaction.atomic():
        case = _lock_open(case)
        if case.message_id and not outbox_transitions.cancel_unknown(case.message_id, reason=reason):
            raise CaseSubjectChanged(f"message {case.message_id} is no longer unknown")
        _decide(case, user=user, decision=Decision.CANCEL, reason=reason, outcome="cancelled", details={})
    return case


# The `resend` policy's budget: a message that has spent its attempts is never resent by
# policy; its case waits for an operator. The sweeper's queue leaves such messages out.
RESEND_BUDGET_LEFT = Q(attempts__lt=F("max_attempts"))


def case_auto_resend(case: ReconciliationCase, *, delay_seconds: float) -> bool:
    """Policy `resend`: queue the message again with the same key and record on the case
    that a duplicate is possible. False if the case or message moved on meanwhile."""
    with transaction.atomic():
        try:
            case = _lock_open(case)
        except CaseNotOpen:
            return False
        message = OutboundMessage.objects.filter(pk=case.message_id).first()
        if message is None or message.state != State.UNKNOWN:
            return False
        if message.attempts >= message.max_attempts:
            # The budget is spent (RESEND_BUDGET_LEFT): never resend forever; the case waits
            # for an operator.
            return False
        if not outbox_services.outbound_message_resend(message.pk, from_states=[State.UNKNOWN]):
            return False
        _decide(
            case,
            user=None,
            decision=Decision.AUTO_RESEND,
            reason=f"on_ambiguous=resend: resent after {delay_seconds:g}s with the same key; a duplicate is possible",
            outcome="queued again with the same key",
            details={"attempts": message.attempts, "duplicate_possible": True},
        )
    return True


def case_close_delivered_late(message: OutboundMessage, *, attempt_number: int) -> ReconciliationCase | None:
    """Telegram answered the message's attempt with success after the sweeper had made it
    `unknown`: the open case (if any) is resolved as delivered, with the reason. A resend
    already decided stays on record; its send finds the message sent and does nothing."""
    case = ReconciliationCase.objects.select_for_update().filter(message=message, status=CaseStatus.OPEN).first()
    reason = f"Telegram answered attempt {attempt_number} with success after its lease had run out"
    if case is None:
        audit_record(
            actor=None,
            action="reconciliation.delivered_late",
            target=f"outbox.OutboundMessage:{message.pk}",
            reason=reason,
            outcome="sent",
            details={"idempotency_key": message.idempotency_key},
        )
        return None
    _decide(
        case,
        user=None,
        decision=Decision.MARK_DELIVERED,
        reason=reason,
        outcome="delivered (late answer)",
        details={"telegram_message_id": message.telegram_message_id, "attempt": attempt_number},
    )
    return case
