"""The sweeper: recovers what crashed workers and a lost broker left behind.

Run by celery-beat every DOVECOTE_SWEEP_INTERVAL_SECONDS. Safe with two beats or two
sweepers at once: every step is a conditional UPDATE on rows whose state and lease it
names, so the second sweeper finds nothing left to change; redispatching the same row
twice is harmless because every task starts with a claim.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.utils import timezone

from bots import services as bot_services
from bots import transitions as bot_transitions
from bots.models import ConsumerRun, InboundUpdate, RunState, UpdateState
from outbox import services as outbox_services
from outbox import transitions as outbox_transitions
from outbox.selectors import outbound_messages_due, outbound_messages_stuck

logger = logging.getLogger(__name__)

# A row due this long ago whose task has not claimed it is taken to have lost its broker
# message (Redis down or flushed) and is published again.
REDISPATCH_GRACE = timedelta(seconds=30)
BATCH = 500


def sweep() -> dict[str, int]:
    now = timezone.now()
    report = {
        "updates_redispatched": 0,
        "runs_released": 0,
        "runs_redispatched": 0,
        "messages_released": 0,
        "messages_unknown": 0,
        "messages_redispatched": 0,
    }
    # Inbox: updates stored but never routed (the publish failed or was lost).
    for pk in InboundUpdate.objects.filter(
        state=UpdateState.NEW, next_attempt_at__lte=now - REDISPATCH_GRACE
    ).values_list("pk", flat=True)[:BATCH]:
        n = InboundUpdate.objects.filter(pk=pk, state=UpdateState.NEW).update(next_attempt_at=now)
        if n and bot_services.dispatch_update(pk):
            report["updates_redispatched"] += 1

    # Consumer runs whose worker died.
    for pk in ConsumerRun.objects.filter(state=RunState.RUNNING, lease_expires_at__lt=now).values_list(
        "pk", flat=True
    )[:BATCH]:
        if bot_transitions.release_expired_run(pk):
            report["runs_released"] += 1
            bot_services.dispatch_run(pk)
    # Consumer runs due but not picked up.
    for pk in ConsumerRun.objects.filter(
        state__in=[RunState.PENDING, RunState.RETRY], next_attempt_at__lte=now - REDISPATCH_GRACE
    ).values_list("pk", flat=True)[:BATCH]:
        n = ConsumerRun.objects.filter(pk=pk, state__in=[RunState.PENDING, RunState.RETRY]).update(next_attempt_at=now)
        if n and bot_services.dispatch_run(pk):
            report["runs_redispatched"] += 1

    # Outbox: sends whose worker died; released if no request started, else unknown.
    for pk in outbound_messages_stuck(limit=BATCH).values_list("pk", flat=True):
        outcome = outbox_transitions.recover_expired_lease(pk)
        if outcome == "released":
            report["messages_released"] += 1
            outbox_services.dispatch(pk)
        elif outcome == "unknown":
            report["messages_unknown"] += 1
    # Outbox: due messages whose broker message was lost.
    for message in outbound_messages_due(overdue_by=REDISPATCH_GRACE, limit=BATCH).only("pk"):
        n = type(message).objects.filter(pk=message.pk, state__in=["pending", "retry"]).update(next_attempt_at=now)
        if n and outbox_services.dispatch(message.pk):
            report["messages_redispatched"] += 1

    if any(report.values()):
        logger.info("sweep: %s", report, extra={"sweep": report})
    return report
