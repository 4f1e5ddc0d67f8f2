"""State changes of reconciliation cases and bulk retries, each one conditional UPDATE.

Case: (none) -> open (an outcome nobody can know) -> resolved (an operator's or the
policy's decision, with who, why and when).
Bulk retry: running -> running (a batch released, its counts) -> done | cancelled.
The sweeper's own lease row (reconciliation/sweeper.py) is taken, renewed and let go there.
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from reconciliation.models import BulkRetry, BulkState, CaseStatus, ReconciliationCase

BULK_PROGRESS_FIELDS = ["released", "requeued", "refused", "skipped", "batches", "reasons", "ticked_at"]


def open_case(*, idempotency_key: str, facts: dict[str, Any], policy: str, **subject: Any) -> ReconciliationCase:
    """A new open case about `message=` or `effect=`; the caller checks that none is open."""
    return ReconciliationCase.objects.create(
        idempotency_key=idempotency_key, known_facts=facts, policy=policy, **subject
    )


def resolve_case(case_id: int, *, decision: str, user: Any, reason: str) -> bool:
    """open -> resolved with the decision. False when the case was not open any more."""
    return (
        ReconciliationCase.objects.filter(pk=case_id, status=CaseStatus.OPEN).update(
            status=CaseStatus.RESOLVED,
            decision=decision,
            decided_by=user if getattr(user, "pk", None) else None,
            decision_reason=reason,
            decided_at=timezone.now(),
        )
        == 1
    )


def record_bulk_progress(bulk: BulkRetry, *, done: bool) -> bool:
    """running -> running with the counts of the batch just released (set on `bulk`), or
    -> done with them when it was the last. False when it was not running any more (an
    operator cancelled it meanwhile): its counts are not overwritten."""
    fields = {name: getattr(bulk, name) for name in BULK_PROGRESS_FIELDS}
    if done:
        fields.update(state=BulkState.DONE, finished_at=timezone.now())
    n = BulkRetry.objects.filter(pk=bulk.pk, state=BulkState.RUNNING).update(**fields)
    if n == 1 and done:
        bulk.state, bulk.finished_at = fields["state"], fields["finished_at"]
    return n == 1


def cancel_bulk_retry(bulk_id: int, *, user: Any) -> bool:
    """running -> cancelled: the rest of the plan is not released."""
    return (
        BulkRetry.objects.filter(pk=bulk_id, state=BulkState.RUNNING).update(
            state=BulkState.CANCELLED, cancelled_by=user, finished_at=timezone.now()
        )
        == 1
    )
