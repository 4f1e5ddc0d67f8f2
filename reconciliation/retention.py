"""One retention pass over every app's tables, and reconciliation's own: decided cases,
payload versions, finished bulk retries and (only when a setting says so) audit entries.

The sweeper calls `retention_pass` on every tick; it works only when retention is due (once
per DOVECOTE_RETENTION_INTERVAL_SECONDS) or when the last pass ran out of its time budget
before it finished, so a backlog is worked off tick after tick instead of an hour apart.

Reconciliation sits on top: it tells the outbox what to keep for it (messages and effects
with an open case) and for the inbox (messages whose update may still run again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db.models import Exists, Model, OuterRef, Q, QuerySet

from bots import retention as bot_retention
from outbox import retention
from outbox.models import DeadLetter, DeadLetterStatus, OutboundMessage, State
from reconciliation.models import (
    AuditEntry,
    BulkRetry,
    BulkState,
    CaseStatus,
    Decision,
    PayloadVersion,
    ReconciliationCase,
)

OPEN_MESSAGE_STATES = [State.PENDING, State.RETRY, State.SENDING]


def case_cutoff(now: datetime) -> datetime | None:
    """Decided cases are kept until here; None: for ever (DOVECOTE_CASE_RETENTION_DAYS = 0)."""
    days = retention.days_setting("DOVECOTE_CASE_RETENTION_DAYS")
    return now - timedelta(days=days) if days > 0 else None


def case_kept_exists(field: str, now: datetime) -> Exists:
    """On OutboundMessage (`message`) or Effect (`effect`): it has a case that must stay - open,
    or decided within the cases' retention - and deleting the row would cascade into it."""
    cases = ReconciliationCase.objects.filter(**{field: OuterRef("pk")})
    cutoff = case_cutoff(now)
    if cutoff is not None:
        cases = cases.filter(Q(status=CaseStatus.OPEN) | Q(decided_at__isnull=True) | Q(decided_at__gte=cutoff))
    return Exists(cases)


def cases_prunable_qs(cutoff: datetime, max_id: int) -> QuerySet[ReconciliationCase]:
    """Cases decided before `cutoff`. An effect's case decided "cancel" stays while its effect
    does: it is what stops the effect from being tried again (receivers.open_effect_case)."""
    return ReconciliationCase.objects.filter(id__lte=max_id, status=CaseStatus.RESOLVED, decided_at__lt=cutoff).exclude(
        effect__isnull=False, decision=Decision.CANCEL
    )


def payload_versions_prunable_qs(cutoff: datetime, max_id: int) -> QuerySet[PayloadVersion]:
    """Versions (they hold the text) of messages whose last correction is older than
    `cutoff`, all of a message's versions at once, and only once the message is settled: not
    waiting or sending, no open dead letter, no open case."""
    newer = PayloadVersion.objects.filter(message_id=OuterRef("message_id"), created_at__gte=cutoff)
    unsettled = OutboundMessage.objects.filter(pk=OuterRef("message_id")).filter(
        Q(state__in=OPEN_MESSAGE_STATES)
        | Exists(DeadLetter.objects.filter(message=OuterRef("pk"), status=DeadLetterStatus.OPEN))
        | Exists(ReconciliationCase.objects.filter(message=OuterRef("pk"), status=CaseStatus.OPEN))
    )
    return PayloadVersion.objects.filter(id__lte=max_id, created_at__lt=cutoff).filter(
        ~Exists(newer), ~Exists(unsettled)
    )


def bulk_retries_prunable_qs(cutoff: datetime, max_id: int) -> QuerySet[BulkRetry]:
    return BulkRetry.objects.filter(
        id__lte=max_id, state__in=[BulkState.DONE, BulkState.CANCELLED], finished_at__lt=cutoff
    )


def audit_entries_prunable_qs(cutoff: datetime, max_id: int) -> QuerySet[AuditEntry]:
    return AuditEntry.objects.filter(id__lte=max_id, created_at__lt=cutoff)


def _by_id(
    name: str, model: type[Model], qs: Callable[[datetime, int], QuerySet[Any]], cutoff: datetime
) -> list[retention.Task]:
    """A task over ids up to the last row created before `cutoff` (ids grow with
    created_at, so the primary key serves as the time index)."""
    boundary = retention.boundary_id(model, "created_at", cutoff)
    if boundary is None:
        return []
    return [retention.Task(name, retention.delete_step(lambda: qs(cutoff, boundary), "pk"))]


def tasks(now: datetime) -> list[retention.Task]:
    """Every app's retention tasks as of `now`, in the order a pass takes their batches
    (text first: the privacy promise)."""
    keep_messages = [case_kept_exists("message", now), *bot_retention.keep_messages()]
    outbox_tasks = retention.tasks(now, keep_messages=keep_messages, keep_effects=[case_kept_exists("effect", now)])
    result = [*outbox_tasks[:1], *bot_retention.tasks(now), *outbox_tasks[1:]]
    days = retention.days_setting
    if (cutoff := case_cutoff(now)) is not None:
        result += _by_id("cases_pruned", ReconciliationCase, cases_prunable_qs, cutoff)
    if (d := days("DOVECOTE_PAYLOAD_VERSION_RETENTION_DAYS")) > 0:
        cutoff = now - timedelta(days=d)
        result += _by_id("payload_versions_pruned", PayloadVersion, payload_versions_prunable_qs, cutoff)
    if (d := days("DOVECOTE_BULK_RETRY_RETENTION_DAYS")) > 0:
        result += _by_id("bulk_retries_pruned", BulkRetry, bulk_retries_prunable_qs, now - timedelta(days=d))
    if (d := days("DOVECOTE_AUDIT_RETENTION_DAYS")) > 0:
        result += _by_id("audit_entries_pruned", AuditEntry, audit_entries_prunable_qs, now - timedelta(days=d))
    return result


# --------------------------------------------------------------------------- when a pass runs
def _redis_key() -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:sweeper:retention"


def _redis() -> Any:
    from core.connections import redis_client

    return redis_client()


def retention_due() -> bool:
    """Retention is hourly work, not every tick's. A Redis key with a TTL marks "a pass
    finished everything less than an interval ago"; while it is absent every sweep runs a
    pass. With Redis down, every sweep does."""
    if int(settings.DOVECOTE_RETENTION_INTERVAL_SECONDS) <= 0:
        return True
    try:
        return not _redis().exists(_redis_key())
    except redis.RedisError:
        return True


def _mark_finished() -> None:
    interval = int(settings.DOVECOTE_RETENTION_INTERVAL_SECONDS)
    if interval <= 0:
        return
    # Should it fail, the next sweep runs a pass again: harmless.
    with contextlib.suppress(redis.RedisError):
        _redis().set(_redis_key(), "1", ex=interval)


def retention_pass(now: datetime, report: dict[str, int]) -> bool | None:
    """One budgeted pass when due. True: nothing old is left (the next pass waits an
    interval); False: the budget ran out (the next sweep continues); None: not due."""
    if not retention_due():
        return None
    finished = retention.run(tasks(now), retention.budget(), report)
    if finished:
        _mark_finished()
    else:
        report["retention_unfinished"] = report.get("retention_unfinished", 0) + 1
    return finished
