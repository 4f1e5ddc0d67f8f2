"""The whole story of a dead letter, for its admin page: what, why, the trace, the ledger."""

from __future__ import annotations

from typing import Any

from django.db.models import Q

from bots.models import ConsumerRun, InboundUpdate
from core.logs import redact
from core.masking import can_view_payload, for_user, mask
from outbox.models import Attempt, DeadLetter, Effect, OutboundMessage
from reconciliation.models import AuditEntry, PayloadVersion, ReconciliationCase


def dead_letter_story(letter: DeadLetter, *, user: Any) -> dict[str, Any]:
    """Everything an operator needs to decide, payloads masked for users without the permission."""
    message = letter.message
    run = letter.consumer_run
    update: InboundUpdate | None = None
    if run is not None:
        update = run.update
    elif message is not None and message.source_update_id:
        update = message.source_update
    elif letter.trace_id:
        update = InboundUpdate.objects.filter(trace_id=letter.trace_id).first()

    trace_filter = Q(trace_id=letter.trace_id) if letter.trace_id else Q(pk__in=[])
    if update is not None:
        trace_filter |= Q(source_update=update)
    messages = list(OutboundMessage.objects.filter(trace_filter).select_related("bot").order_by("pk")[:50])
    if message is not None and message not in messages:
        messages.insert(0, message)
    runs = list(ConsumerRun.objects.filter(update=update).order_by("pk")) if update else []

    ledger_filter = Q(key=letter.idempotency_key) if letter.idempotency_key else Q(pk__in=[])
    if run is not None:
        ledger_filter |= Q(key__startswith=f"eff:{run.bot_id}:{run.update.update_id}:{run.consumer}:")
    if letter.trace_id:
        ledger_filter |= Q(trace_id=letter.trace_id)
    effects = list(Effect.objects.filter(ledger_filter).order_by("created_at")[:50])

    case_filter = Q(idempotency_key=letter.idempotency_key) if letter.idempotency_key else Q(pk__in=[])
    if message is not None:
        case_filter |= Q(message=message)
    if effects:
        case_filter |= Q(effect__in=effects)
    cases = list(ReconciliationCase.objects.filter(case_filter).select_related("decided_by").distinct()[:20])

    attempts = list(Attempt.objects.filter(message=message).order_by("number")) if message else []
    versions = (
        [
            {
                "number": v.number,
                "author": v.author,
                "reason": v.reason,
                "created_at": v.created_at,
                "payload": for_user(user, v.payload),
            }
            for v in PayloadVersion.objects.filter(message=message).select_related("author")
        ]
        if message
        else []
    )
    if not can_view_payload(user):
        # Error texts and results may echo a CRM's or model's body: redacted on these
        # in-memory copies (never saved), as payloads are masked.
        _redact_errors(attempts, "description")
        _redact_errors([*runs, *([run] if run else []), *([update] if update else [])], "last_error")
        _redact_errors([*effects, *messages], "last_error")
        for row in [*effects, *messages]:
            row.result = mask(row.result)
    return {
        "message": message,
        "payload": for_user(user, message.payload) if message else None,
        "attempts": attempts,
        "versions": versions,
        "run": run,
        "update": update,
        "update_payload": for_user(user, update.payload) if update else None,
        "runs": runs,
        "trace_messages": [{"m": m, "payload": for_user(user, m.payload)} for m in messages],
        "effects": effects,
        "cases": cases,
        "audit": list(AuditEntry.objects.filter(target=f"outbox.DeadLetter:{letter.pk}").select_related("actor")[:50]),
    }


def _redact_errors(rows: list[Any], field: str) -> None:
    for row in rows:
        setattr(row, field, redact(getattr(row, field) or ""))
