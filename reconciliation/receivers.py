"""Reconciliation listens to the outbox (which cannot import it)."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from outbox.models import Effect, OutboundMessage
from outbox.signals import effect_ambiguous, message_ambiguous
from reconciliation.models import CaseStatus, Decision, ReconciliationCase


@receiver(message_ambiguous, sender=OutboundMessage, dispatch_uid="reconciliation.open_case")
def open_case(sender: Any, message: OutboundMessage, facts: dict[str, Any], **kwargs: Any) -> None:
    """Runs inside the transaction that made the message `unknown`."""
    if ReconciliationCase.objects.filter(message=message, status=CaseStatus.OPEN).exists():
        return
    ReconciliationCase.objects.create(
        message=message,
        idempotency_key=message.idempotency_key,
        known_facts={**facts, "kind": "outbound_message", "method": message.method, "chat_id": message.chat_id},
        policy=message.on_ambiguous,
    )


@receiver(effect_ambiguous, sender=Effect, dispatch_uid="reconciliation.open_effect_case")
def open_effect_case(sender: Any, effect: Effect, facts: dict[str, Any], **kwargs: Any) -> None:
    """One case per ambiguous effect: the barrier fires this on every refused run, so an
    open case (or an operator's cancel, which means "never do it") is not duplicated."""
    existing = ReconciliationCase.objects.filter(effect=effect).filter(
        status=CaseStatus.OPEN
    ) | ReconciliationCase.objects.filter(effect=effect, decision=Decision.CANCEL)
    if existing.exists():
        return
    ReconciliationCase.objects.create(
        effect=effect,
        idempotency_key=effect.key,
        known_facts={**facts, "kind": "effect"},
        policy="hold",
    )
