"""Reconciliation listens to the outbox (which cannot import it)."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from outbox.models import OutboundMessage
from outbox.signals import message_ambiguous
from reconciliation.models import CaseStatus, ReconciliationCase


@receiver(message_ambiguous, sender=OutboundMessage, dispatch_uid="reconciliation.open_case")
def open_case(sender: Any, message: OutboundMessage, facts: dict[str, Any], **kwargs: Any) -> None:
    """Runs inside the transaction that made the message `unknown`."""
    if ReconciliationCase.objects.filter(message=message, status=CaseStatus.OPEN).exists():
        return
    ReconciliationCase.objects.create(
        message=message,
        idempotency_key=message.idempotency_key,
        known_facts=facts,
        policy=message.on_ambiguous,
    )
