"""Reconciliation listens to the outbox (which cannot import it)."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from core import metrics
from outbox.models import Effect, OutboundMessage
from outbox.signals import effect_ambiguous, message_ambiguous, message_delivered_late
from reconciliation import transitions
from reconciliation.models import CaseStatus, Decision, ReconciliationCase


@receiver(message_ambiguous, sender=OutboundMessage, dispatch_uid="reconciliation.open_case")
def open_case(sender: Any, message: OutboundMessage, facts: dict[str, Any], **kwargs: Any) -> None:
    """Runs inside the transaction that made the message `unknown`."""
    if ReconciliationCase.objects.filter(message=message, status=CaseStatus.OPEN).exists():
        return
    transitions.open_case(
        message=message,
        idempotency_key=message.idempotency_key,
        facts={**facts, "kind": "outbound_message", "method": message.method, "chat_id": message.chat_id},
        policy=message.on_ambiguous,
    )
    metrics.CASES_OPENED.labels(kind="outbound_message").inc()


@receiver(message_delivered_late, sender=OutboundMessage, dispatch_uid="reconciliation.close_case_delivered_late")
def close_case_delivered_late(sender: Any, message: OutboundMessage, attempt_number: int, **kwargs: Any) -> None:
    """Telegram's answer settled the message after all: its open case is decided as
    delivered, by nobody, and the decision is audited like an operator's."""
    from reconciliation.services import case_close_delivered_late

    case_close_delivered_late(message, attempt_number=attempt_number)


@receiver(effect_ambiguous, sender=Effect, dispatch_uid="reconciliation.open_effect_case")
def open_effect_case(sender: Any, effect: Effect, facts: dict[str, Any], **kwargs: Any) -> None:
    """One case per ambiguous effect: the barrier fires this on every refused run, so an
    open case (or an operator's cancel, which means "never do it") is not duplicated."""
    existing = ReconciliationCase.objects.filter(effect=effect).filter(
        status=CaseStatus.OPEN
    ) | ReconciliationCase.objects.filter(effect=effect, decision=Decision.CANCEL)
    if existing.exists():
        return
    transitions.open_case(effect=effect, idempotency_key=effect.key, facts={**facts, "kind": "effect"}, policy="hold")
    metrics.CASES_OPENED.labels(kind="effect").inc()
