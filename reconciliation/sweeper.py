"""The sweeper: recovers what crashed workers and a lost broker left behind.

Run by celery-beat every DOVECOTE_SWEEP_INTERVAL_SECONDS. One sweep returns runs and updates
whose lease expired, moves sends stuck past their lease to retry or `unknown` (with a case),
resends `unknown` messages whose policy is `resend`, cancels work past its max age, redispatches
due rows whose broker message was lost, runs a retention pass, and sends the ops digest. Two
sweepers at once: one runs, the other returns {"skipped": 1}; the guard is a lease row, not an
advisory lock (PgBouncer). Every query is one of the `*_qs` functions, each served by a partial
index. The steps and the lease's reasons: docs/DESIGN.md."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import DatabaseError
from django.db.models import DateTimeField, Exists, ExpressionWrapper, F, Min, OuterRef, Q, QuerySet
from django.db.models.functions import Now
from django.utils import timezone

from bots import registry
from bots import transitions as bot_transitions
from bots.models import Bot, ConsumerRun, InboundUpdate, RunState, UpdateState
from bots.routing import dispatch_update
from bots.runs import consumer_run_end_stale, consumer_run_recover_expired, dispatch_run
from core import connections, metrics
from outbox import chat_order, circuits, dispatch, policy
from outbox import transitions as outbox_transitions
from outbox.models import Circuit, CircuitState, ErrorClass, OnAmbiguous, OutboundMessage, State
from outbox.sending import probe
from reconciliation import retention, triage
from reconciliation import services as reconciliation_services
from reconciliation.models import BulkRetry, BulkState, CaseStatus, ReconciliationCase, SweeperLease

logger = logging.getLogger(__name__)

BATCH = 500
# The one SweeperLease row.
LEASE_PK = 1
WAITING = [State.PENDING, State.RETRY]
RUN_WAITING = [RunState.PENDING, RunState.RETRY]


def redispatch_grace() -> timedelta:
    return timedelta(seconds=settings.DOVECOTE_REDISPATCH_GRACE_SECONDS)


# --------------------------------------------------------------------------- queries
def updates_unrouted_qs(now: datetime) -> QuerySet[InboundUpdate]:
    return InboundUpdate.objects.filter(state=UpdateState.NEW, next_attempt_at__lte=now - redispatch_grace())


def runs_expired_qs(now: datetime) -> QuerySet[ConsumerRun]:
    return ConsumerRun.objects.filter(state=RunState.RUNNING, lease_expires_at__lt=now)


def runs_due_qs(now: datetime) -> QuerySet[ConsumerRun]:
    return ConsumerRun.objects.filter(state__in=RUN_WAITING, next_attempt_at__lte=now - redispatch_grace())


def runs_too_old_qs(consumer: str, cutoff: datetime) -> QuerySet[ConsumerRun]:
    return ConsumerRun.objects.filter(state__in=RUN_WAITING, consumer=consumer, update__received_at__lt=cutoff)


def messages_stuck_qs(now: datetime) -> QuerySet[OutboundMessage]:
    return OutboundMessage.objects.filter(state=State.SENDING, lease_expires_at__lt=now)


def messages_expired_qs(now: datetime) -> QuerySet[OutboundMessage]:
    return OutboundMessage.objects.filter(state__in=WAITING, expires_at__lte=now)


def messages_to_auto_resend_qs(now: datetime) -> QuerySet[OutboundMessage]:
    """Unknown messages the `resend` policy may still resend: a message whose budget is
    spent, or without an open case, stays unknown for good and would otherwise hold the
    head of this queue (oldest first, BATCH at a time) against the ones behind it."""
    delay = timedelta(seconds=settings.DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS)
    open_case = ReconciliationCase.objects.filter(message=OuterRef("pk"), status=CaseStatus.OPEN)
    return OutboundMessage.objects.filter(
        reconciliation_services.RESEND_BUDGET_LEFT,
        Exists(open_case),
        # An expired message is not resent by policy: it would only expire again.
        Q(expires_at__isnull=True) | Q(expires_at__gt=now),
        state=State.UNKNOWN,
        updated_at__lte=now - delay,
        on_ambiguous=OnAmbiguous.RESEND,
    )


def broadcasts_overdue_bots_qs(now: datetime) -> QuerySet[OutboundMessage]:
    """The bots with a broadcast message due the redispatch grace ago and not claimed: their
    broadcast drain was lost (outbox_bulk_due_idx)."""
    overdue = OutboundMessage.objects.filter(state__in=WAITING, next_attempt_at__lte=now - redispatch_grace())
    return overdue.exclude(broadcast="").order_by("bot_id").values_list("bot_id", flat=True).distinct()


def messages_due_qs(
    now: datetime, *, bot_id: int | None = None, overdue_by: timedelta | None = None
) -> QuerySet[OutboundMessage]:
    """Waiting messages due `overdue_by` ago (default: the redispatch grace, i.e. their
    broker message was lost) that their chat's order lets go now (outbox/chat_order.py):
    a later message of a chat is never chosen before its head."""
    overdue = redispatch_grace() if overdue_by is None else overdue_by
    qs = OutboundMessage.objects.filter(state__in=WAITING, next_attempt_at__lte=now - overdue)
    if bot_id is not None:
        qs = qs.filter(bot_id=bot_id)
    return chat_order.heads(qs, now=now)


# --------------------------------------------------------------------------- the lease
def _lease_until() -> ExpressionWrapper:
    ttl = timedelta(seconds=settings.DOVECOTE_SWEEP_LEASE_SECONDS)
    return ExpressionWrapper(Now() + ttl, output_field=DateTimeField())


def lease_take(holder: str) -> bool:
    """Take the lease if it is free or expired: one conditional UPDATE (the row is created
    on first use; transactional tests flush it, so no data migration is relied on)."""
    SweeperLease.objects.bulk_create([SweeperLease(pk=LEASE_PK)], ignore_conflicts=True)
    free = Q(expires_at__isnull=True) | Q(expires_at__lt=Now())
    return bool(SweeperLease.objects.filter(free, pk=LEASE_PK).update(holder=holder, expires_at=_lease_until()))


def lease_renew(holder: str) -> bool:
    """Extend our lease; False if it expired and another sweeper took it."""
    return bool(SweeperLease.objects.filter(pk=LEASE_PK, holder=holder).update(expires_at=_lease_until()))


def lease_release(holder: str) -> None:
    SweeperLease.objects.filter(pk=LEASE_PK, holder=holder).update(holder="", expires_at=None)


@contextmanager
def sweep_lease() -> Iterator[str | None]:
    """The holder name when this process may sweep, else None. Freed at the end; a killed
    sweeper's lease expires after DOVECOTE_SWEEP_LEASE_SECONDS."""
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    if not lease_take(holder):
        yield None
        return
    try:
        yield holder
    finally:
        try:
            lease_release(holder)
        except DatabaseError as exc:
            # The lease expires by itself.
            logger.warning("could not free the sweeper lease: %s", exc)


# --------------------------------------------------------------------------- the steps
def _ids(qs: QuerySet[Any], order: str, limit: int = BATCH) -> list[int]:
    return list(qs.order_by(order).values_list("pk", flat=True)[:limit])


def _recover_inbox(now: datetime, report: dict[str, int]) -> None:
    # Updates stored but never routed (the publish failed or was lost).
    for pk in _ids(updates_unrouted_qs(now), "next_attempt_at"):
        if bot_transitions.make_update_due(pk, now=now) and dispatch_update(pk):
            report["updates_redispatched"] += 1


def _recover_runs(now: datetime, report: dict[str, int]) -> None:
    # A lost worker's run: that attempt failed. Retried with backoff, or dead-lettered when
    # it was the last one (bots.runs.consumer_run_recover_expired).
    for pk in _ids(runs_expired_qs(now), "lease_expires_at"):
        outcome = consumer_run_recover_expired(pk)
        if outcome == "released":
            report["runs_released"] += 1
        elif outcome == "dead-lettered":
            report["runs_dead_lettered"] += 1
    # Runs older than their consumer's max age are not run late: cancelled with a reason, or
    # dead-lettered when a failure is on record (bots.runs.consumer_run_end_stale).
    for spec in registry.registered().values():
        cutoff = now - spec.max_age
        runs = ConsumerRun.objects.select_related("update").filter(
            pk__in=_ids(runs_too_old_qs(spec.name, cutoff), "next_attempt_at")
        )
        for run in runs:
            outcome = consumer_run_end_stale(run, spec=spec)
            if outcome == "cancelled":
                report["runs_cancelled_too_old"] += 1
            elif outcome == "dead-lettered":
                report["runs_dead_lettered_too_old"] += 1
    for pk in _ids(runs_due_qs(now), "next_attempt_at"):
        if bot_transitions.make_run_due(pk, now=now) and dispatch_run(pk):
            report["runs_redispatched"] += 1


def _recover_sends(now: datetime, report: dict[str, int]) -> None:
    # Sends whose worker died: released if no request started, else unknown (+ a case).
    released = []
    for pk in _ids(messages_stuck_qs(now), "lease_expires_at"):
        outcome = outbox_transitions.recover_expired_lease(pk)
        if outcome == "released":
            report["messages_released"] += 1
            released.append(pk)
        elif outcome == "unknown":
            report["messages_unknown"] += 1
    dispatch.hand_on(released)
    # Policy `resend`: after the delay, the same key again; the case says a duplicate is possible.
    for pk in _ids(messages_to_auto_resend_qs(now), "updated_at"):
        case = ReconciliationCase.objects.filter(message_id=pk, status=CaseStatus.OPEN).first()
        if case is not None and reconciliation_services.case_auto_resend(
            case, delay_seconds=settings.DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS
        ):
            report["messages_auto_resent"] += 1
    for pk in _ids(messages_expired_qs(now), "next_attempt_at"):
        if outbox_transitions.cancel(pk, reason="expired before it could be sent", error_class=ErrorClass.EXPIRED):
            report["messages_expired"] += 1


def _redispatch_sends(now: datetime, report: dict[str, int]) -> None:
    """Due messages whose broker message was lost. A bot whose circuit is open gets its
    probe woken when it is due (its task was lost: outbox/sending/probe.py); the rest, a
    batch through their bots' drains."""
    special: list[int] = []
    for circuit in Circuit.objects.filter(
        scope__startswith=circuits.BOT_PREFIX, state__in=[CircuitState.OPEN, CircuitState.HALF_OPEN]
    ):
        parsed = circuits.parse_scope(circuit.scope)
        if parsed is None:
            continue
        bot_id = int(parsed[1])
        special.append(bot_id)
        probe_due = not circuit.manual and circuit.next_probe_at is not None and circuit.next_probe_at <= now
        if probe_due and probe.schedule_probe(bot_id, 0.0):
            report["messages_probes"] += 1
    qs = messages_due_qs(now)
    if special:
        qs = qs.exclude(bot_id__in=special)
    if dispatch.drain_enabled():
        # Broadcasts are their bot's broadcast drain's, a batch at a time: one wake-up per
        # bot whose broadcast waits overdue (its drain was lost), no row made due one by one.
        qs = qs.filter(broadcast="")
        for bot_id in broadcasts_overdue_bots_qs(now).exclude(bot_id__in=special):
            if dispatch.wake_bulk_drain(bot_id):
                report["broadcast_drains_woken"] += 1
    report["messages_redispatched"] += dispatch.redispatch(_ids(qs, "next_attempt_at"), now)


def _parked_due_soon(now: datetime) -> Q:
    """Rows falling due before the sweep after next whose wait was longer than a broker
    countdown may be: written more than that long before they fall due, so nobody published
    them and the row alone holds the wait."""
    tick = timedelta(seconds=float(settings.DOVECOTE_SWEEP_INTERVAL_SECONDS))
    # Two ticks ahead: a late or slow beat tick leaves no gap; a row in the overlap is
    # published twice, and the second task finds it claimed or sent.
    return Q(next_attempt_at__gt=now, next_attempt_at__lte=now + 2 * tick) & Q(
        next_attempt_at__gt=F("updated_at") + timedelta(seconds=policy.MAX_BROKER_COUNTDOWN_SECONDS)
    )


def messages_upcoming_qs(now: datetime) -> QuerySet[OutboundMessage]:
    return OutboundMessage.objects.filter(_parked_due_soon(now), state__in=WAITING)


def broadcasts_upcoming_qs(now: datetime) -> QuerySet[OutboundMessage]:
    """Per bot, when its first parked broadcast message falls due before the sweep after next."""
    parked = OutboundMessage.objects.filter(_parked_due_soon(now), state__in=WAITING).exclude(broadcast="")
    return parked.values("bot_id").annotate(due=Min("next_attempt_at")).order_by("bot_id")


def runs_upcoming_qs(now: datetime) -> QuerySet[ConsumerRun]:
    return ConsumerRun.objects.filter(_parked_due_soon(now), state__in=RUN_WAITING)


def _publish_upcoming(now: datetime, report: dict[str, int]) -> None:
    """Waits longer than a broker countdown (`send_at`, long backoffs, a long retry_after)
    are parked in their rows; each sweep publishes those that fall due before the next
    sweep with their exact countdown, so they go on time rather than a redispatch grace
    late. The task starts with a claim: one that finds the row moved on does nothing."""
    qs = messages_upcoming_qs(now)
    if dispatch.drain_enabled():
        # A broadcast (its send_at) wakes its bot's broadcast drain then, once.
        qs = qs.filter(broadcast="")
        for row in broadcasts_upcoming_qs(now):
            if dispatch.wake_bulk_drain(row["bot_id"], countdown=max(0.0, (row["due"] - now).total_seconds())):
                report["broadcast_drains_woken"] += 1
    upcoming = qs.order_by("next_attempt_at").values_list("pk", "next_attempt_at", "broadcast")[:BATCH]
    for pk, due, broadcast in upcoming:
        if dispatch.dispatch(pk, countdown=max(0.0, (due - now).total_seconds()), bulk=bool(broadcast)):
            report["messages_published_ahead"] += 1
    for pk, due in runs_upcoming_qs(now).order_by("next_attempt_at").values_list("pk", "next_attempt_at")[:BATCH]:
        if dispatch_run(pk, countdown=max(0.0, (due - now).total_seconds())):
            report["runs_published_ahead"] += 1


def _sweeper_key() -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:sweeper:last-run"


def _record_last_run(finished: datetime) -> None:
    """When the last sweep finished: /readyz and /metrics show it, so a dead beat is seen."""
    try:
        connections.shared_redis().set(_sweeper_key(), finished.timestamp())
    except redis.RedisError as exc:
        logger.warning("could not record the sweep's time: %s", exc)


def sweeper_last_run() -> datetime | None:
    """When a sweep last finished (any process), or None if unknown (never, or Redis down)."""
    try:
        value = connections.shared_redis().get(_sweeper_key())
    except redis.RedisError:
        return None
    return None if value is None else datetime.fromtimestamp(float(value), tz=UTC)


def _retention(now: datetime, report: dict[str, int]) -> None:
    retention.retention_pass(now, report)


def bulk_retries_stalled_qs(now: datetime) -> QuerySet[BulkRetry]:
    """Running bulk retries whose next tick is overdue: its broker message was lost."""
    return BulkRetry.objects.filter(state=BulkState.RUNNING, ticked_at__lt=now - redispatch_grace())


def _resume_bulk_retries(now: datetime, report: dict[str, int]) -> None:
    for bulk in bulk_retries_stalled_qs(now).only("pk", "tick_seconds", "ticked_at"):
        if bulk.ticked_at and (now - bulk.ticked_at).total_seconds() < 3 * bulk.tick_seconds:
            continue  # a slow tick, not a lost one
        # The tick carries the cursor: should the lost one turn up after all, it stops.
        if triage.bulk_retry_schedule(bulk.pk):
            report["bulk_retries_resumed"] += 1


def _ops_digest(now: datetime, report: dict[str, int]) -> None:
    """The ops digest rides on the sweep: every sweep may send it, each kind at most once per
    window (reconciliation/digest.py); no beat task of its own to schedule and watch."""
    from reconciliation import digest

    try:
        report["ops_digests"] = len(digest.flush(now))
    except Exception:
        # Redis down, a query failing: the digest waits; the sweep and its record go on.
        logger.exception("ops digest skipped this sweep")


def _prune_metrics(now: datetime, report: dict[str, int]) -> None:
    """A deleted bot's counters, and a renamed bot's under its old name, leave /metrics.
    The bots table is a handful of rows, read whole (not a `*_qs` of the big tables)."""
    report["metric_series_pruned"] = metrics.prune_bots(lambda: set(Bot.objects.values_list("name", flat=True)))


STEPS = (
    _recover_inbox,
    _recover_runs,
    _recover_sends,
    _redispatch_sends,
    _publish_upcoming,
    _resume_bulk_retries,
    _retention,
    _ops_digest,
    _prune_metrics,
)


def sweep() -> dict[str, int]:
    """One sweep; returns what it did. With another sweeper running: {"skipped": 1}."""
    report = dict.fromkeys(
        (
            "updates_redispatched",
            "runs_released",
            "runs_dead_lettered",
            "runs_cancelled_too_old",
            "runs_dead_lettered_too_old",
            "runs_redispatched",
            "messages_released",
            "messages_unknown",
            "messages_auto_resent",
            "messages_expired",
            "messages_probes",
            "messages_redispatched",
            "messages_published_ahead",
            "broadcast_drains_woken",
            "runs_published_ahead",
            "bulk_retries_resumed",
            "payloads_purged",
            "idempotency_records_pruned",
            "effects_pruned",
            "messages_pruned",
            "updates_pruned",
            "inbound_payloads_purged",
            "handler_results_purged",
            "chat_states_pruned",
            "cases_pruned",
            "payload_versions_pruned",
            "bulk_retries_pruned",
            "audit_entries_pruned",
            "retention_unfinished",
            "metric_series_pruned",
        ),
        0,
    )
    with sweep_lease() as holder:
        if holder is None:
            logger.info("sweep skipped: another sweeper holds the lease")
            return {"skipped": 1}
        for step in STEPS:
            # Each step re-reads the clock: a long step must not make the next act on
            # a stale "now" (e.g. recovering a lease that was renewed meanwhile).
            step(timezone.now(), report)
            if not lease_renew(holder):
                # A step outlasted the lease and another sweeper took over: leave it the rest.
                logger.warning("sweep stopped after %s: the lease expired and was taken", step.__name__)
                break
        _record_last_run(timezone.now())
    done = {k: v for k, v in report.items() if v}
    if done:
        logger.info("sweep: %s", done, extra={"sweep": done})
    return report
