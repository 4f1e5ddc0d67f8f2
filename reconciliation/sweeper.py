"""The sweeper: recovers what crashed workers and a lost broker left behind.

Run by celery-beat every DOVECOTE_SWEEP_INTERVAL_SECONDS (scheduled by the data migration
reconciliation/0002, so `beat` needs no set-up). One sweep:

1. returns inbox updates and consumer runs whose lease expired (worker died) to the queue;
2. moves outbox messages stuck in `sending` past their lease to retry (no request started)
   or to the ambiguous path (`unknown` + a reconciliation case);
3. resends `unknown` messages whose policy is `resend`, after
   DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS, recording that a duplicate is possible;
4. cancels work past its max age with a reason (messages past `expires_at`, consumer runs
   older than their consumer's `max_age`);
5. redispatches due rows whose broker message was lost - gradually for a destination whose
   circuit just closed, one probe for one whose circuit is open - and resumes a running bulk
   retry whose next tick was lost;
6. purges payloads past retention and prunes ledger (Effect) and dedupe (InboundUpdate)
   rows older than DOVECOTE_LEDGER_RETENTION_DAYS (never under Telegram's 24 h), and sent or
   cancelled messages older than DOVECOTE_OUTBOX_RETENTION_DAYS with their attempts - at
   most once per DOVECOTE_RETENTION_INTERVAL_SECONDS (default 3600).

Two sweepers at once (two beats, a manual run): on PostgreSQL a session advisory lock lets
one run and the other return at once; PostgreSQL drops the lock with the session, so a
sweeper killed mid-sweep cannot orphan it. Underneath, every step is still a conditional
UPDATE naming the state it expects, and a redispatched task starts with a claim.

Every query below is one of the `*_qs` functions, each served by a partial index
(tests/reconciliation/test_sweeper_plans.py EXPLAINs them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import Exists, F, OuterRef, Q, QuerySet
from django.utils import timezone

from bots import registry
from bots import services as bot_services
from bots import transitions as bot_transitions
from bots.models import Bot, ConsumerRun, InboundUpdate, RunState, UpdateState
from outbox import chat_order, circuits, drain, policy, ratelimit
from outbox import services as outbox_services
from outbox import transitions as outbox_transitions
from outbox.idempotency import idempotency_records_prune
from outbox.models import Circuit, CircuitState, Effect, EffectState, ErrorClass, OnAmbiguous, OutboundMessage, State
from reconciliation import services as reconciliation_services
from reconciliation import triage
from reconciliation.models import BulkRetry, BulkState, CaseStatus, ReconciliationCase

logger = logging.getLogger(__name__)

BATCH = 500
PRUNE_BATCH = 1000
# pg_advisory_lock key: "dove" in ASCII.
SWEEP_LOCK_KEY = 0x646F7665
WAITING = [State.PENDING, State.RETRY]
RUN_WAITING = [RunState.PENDING, RunState.RETRY]


def redispatch_grace() -> timedelta:
    return timedelta(seconds=settings.DOVECOTE_REDISPATCH_GRACE_SECONDS)


# Kept for callers that read it (tests shift rows back by it).
REDISPATCH_GRACE = timedelta(seconds=30)


# --------------------------------------------------------------------------- queries
def updates_unrouted_qs(now: datetime) -> QuerySet[InboundUpdate]:
    return InboundUpdate.objects.filter(state=UpdateState.NEW, next_attempt_at__lte=now - redispatch_grace())


def updates_expired_qs(now: datetime) -> QuerySet[InboundUpdate]:
    return InboundUpdate.objects.filter(state=UpdateState.PROCESSING, lease_expires_at__lt=now)


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
        state=State.UNKNOWN,
        updated_at__lte=now - delay,
        on_ambiguous=OnAmbiguous.RESEND,
    )


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


def effects_prunable_qs(cutoff: datetime) -> QuerySet[Effect]:
    # Unknown and started effects are kept: they have cases, or may still be running.
    return Effect.objects.filter(created_at__lt=cutoff, state__in=[EffectState.DONE, EffectState.FAILED])


def messages_prunable_qs(cutoff: datetime) -> QuerySet[OutboundMessage]:
    """Sent and cancelled messages last changed before `cutoff`, with their attempts, and with
    no open dead letter or case (failed and unknown messages are an operator's business)."""
    from outbox.models import DeadLetter, DeadLetterStatus

    open_letters = DeadLetter.objects.filter(message=OuterRef("pk"), status=DeadLetterStatus.OPEN)
    open_cases = ReconciliationCase.objects.filter(message=OuterRef("pk"), status=CaseStatus.OPEN)
    return OutboundMessage.objects.filter(state__in=[State.SENT, State.CANCELLED], updated_at__lt=cutoff).filter(
        ~Exists(open_letters), ~Exists(open_cases)
    )


def updates_prunable_qs(cutoff: datetime, max_id: int) -> QuerySet[InboundUpdate]:
    unfinished_runs = ConsumerRun.objects.filter(update=OuterRef("pk")).exclude(
        state__in=[RunState.DONE, RunState.CANCELLED]
    )
    return InboundUpdate.objects.filter(id__lte=max_id, state=UpdateState.DONE, received_at__lt=cutoff).filter(
        ~Exists(unfinished_runs)
    )


# --------------------------------------------------------------------------- the lock
@contextmanager
def sweep_lock() -> Iterator[bool]:
    """True when this process may sweep. PostgreSQL: a session advisory lock, released at
    the end or by PostgreSQL when a killed sweeper's connection goes away."""
    if connection.vendor != "postgresql":
        yield True
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [SWEEP_LOCK_KEY])
        got = bool(cursor.fetchone()[0])
    try:
        yield got
    finally:
        if got:
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s)", [SWEEP_LOCK_KEY])
            except DatabaseError:
                # Closing the session releases the lock too.
                connection.close()


# --------------------------------------------------------------------------- the steps
def _ids(qs: QuerySet[Any], order: str, limit: int = BATCH) -> list[int]:
    return list(qs.order_by(order).values_list("pk", flat=True)[:limit])


def _recover_inbox(now: datetime, report: dict[str, int]) -> None:
    # Updates stored but never routed (the publish failed or was lost).
    for pk in _ids(updates_unrouted_qs(now), "next_attempt_at"):
        n = InboundUpdate.objects.filter(pk=pk, state=UpdateState.NEW).update(next_attempt_at=now)
        if n and bot_services.dispatch_update(pk):
            report["updates_redispatched"] += 1
    # Updates whose router died holding them (the inbox has no such state in use today,
    # but a row left `processing` must not be stranded): back to new.
    for pk in _ids(updates_expired_qs(now), "lease_expires_at"):
        n = InboundUpdate.objects.filter(pk=pk, state=UpdateState.PROCESSING, lease_expires_at__lt=now).update(
            state=UpdateState.NEW, next_attempt_at=now, lease_owner="", lease_expires_at=None
        )
        if n and bot_services.dispatch_update(pk):
            report["updates_released"] += 1


def _recover_runs(now: datetime, report: dict[str, int]) -> None:
    for pk in _ids(runs_expired_qs(now), "lease_expires_at"):
        if bot_transitions.release_expired_run(pk):
            report["runs_released"] += 1
            bot_services.dispatch_run(pk)
    # Runs older than their consumer's max age are not run late: cancelled with a reason.
    for spec in registry.registered().values():
        cutoff = now - spec.max_age
        for pk in _ids(runs_too_old_qs(spec.name, cutoff), "next_attempt_at"):
            reason = f"older than the consumer's max age ({spec.max_age}); not run late"
            if bot_transitions.cancel_run(pk, reason=reason):
                report["runs_cancelled_too_old"] += 1
    for pk in _ids(runs_due_qs(now), "next_attempt_at"):
        n = ConsumerRun.objects.filter(pk=pk, state__in=RUN_WAITING).update(next_attempt_at=now)
        if n and bot_services.dispatch_run(pk):
            report["runs_redispatched"] += 1


def _recover_sends(now: datetime, report: dict[str, int]) -> None:
    # Sends whose worker died: released if no request started, else unknown (+ a case).
    for pk in _ids(messages_stuck_qs(now), "lease_expires_at"):
        outcome = outbox_transitions.recover_expired_lease(pk)
        if outcome == "released":
            report["messages_released"] += 1
            outbox_services.dispatch(pk)
        elif outcome == "unknown":
            report["messages_unknown"] += 1
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


def _redispatch(pks: list[int], now: datetime, *, probe: bool = False) -> int:
    """Make the messages due now and hand them to workers: through their bot's drain (one
    wake-up per bot: a live drain takes them in turn, a lost one's key expires within
    seconds and the next sweep wakes a new one), except a circuit's probe and broadcasts,
    which go one by one."""
    drained = not probe and drain.enabled()
    bots = dict(OutboundMessage.objects.filter(pk__in=pks, broadcast="").values_list("pk", "bot_id")) if drained else {}
    sent = 0
    woken: dict[int, list[int]] = {}
    for pk in pks:
        if not OutboundMessage.objects.filter(pk=pk, state__in=WAITING).update(next_attempt_at=now):
            continue
        if pk in bots:
            woken.setdefault(bots[pk], []).append(pk)
        elif outbox_services.dispatch(pk):
            sent += 1
    for bot_id, bot_pks in woken.items():
        if drain.wake(bot_id):
            sent += len(bot_pks)
    return sent


def _redispatch_sends(now: datetime, report: dict[str, int]) -> None:
    """Due messages whose broker message was lost. A bot whose circuit is open gets one
    message released when its probe is due (the send path takes the probe); a bot whose
    circuit just closed gets a growing batch per tick (the ramp); the rest, a batch."""
    tick = float(settings.DOVECOTE_SWEEP_INTERVAL_SECONDS)
    recent = now - timedelta(seconds=tick * circuits.RAMP_TICKS)
    special: list[int] = []
    for circuit in Circuit.objects.filter(scope__startswith="bot:").filter(
        Q(state__in=[CircuitState.OPEN, CircuitState.HALF_OPEN])
        | Q(state=CircuitState.CLOSED, opened_at__isnull=False, updated_at__gte=recent)
    ):
        try:
            bot_id = int(circuit.scope.removeprefix("bot:"))
        except ValueError:
            continue
        special.append(bot_id)
        if circuit.state != CircuitState.CLOSED:
            probe_due = not circuit.manual and circuit.next_probe_at is not None and circuit.next_probe_at <= now
            if probe_due:
                # The probe is a chat's head that is due now: a later message of its chat
                # would only wait for the head, and the probe's turn would pass unused.
                probe = _ids(messages_due_qs(now, bot_id=bot_id, overdue_by=timedelta(0)), "next_attempt_at", 1)
                report["messages_probes"] += _redispatch(probe, now, probe=True)
            continue
        rate = Bot.objects.filter(pk=bot_id).values_list("rate_limit", flat=True).first()
        allowance = circuits.bot_ramp_allowance(circuit, rate=rate)
        limit = BATCH if allowance is None else min(BATCH, allowance)
        batch = _ids(messages_due_qs(now, bot_id=bot_id, overdue_by=timedelta(0)), "next_attempt_at", limit)
        report["messages_ramped"] += _redispatch(batch, now)
    qs = messages_due_qs(now)
    if special:
        qs = qs.exclude(bot_id__in=special)
    report["messages_redispatched"] += _redispatch(_ids(qs, "next_attempt_at"), now)


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


def runs_upcoming_qs(now: datetime) -> QuerySet[ConsumerRun]:
    return ConsumerRun.objects.filter(_parked_due_soon(now), state__in=RUN_WAITING)


def _publish_upcoming(now: datetime, report: dict[str, int]) -> None:
    """Waits longer than a broker countdown (`send_at`, long backoffs, a long retry_after)
    are parked in their rows; each sweep publishes those that fall due before the next
    sweep with their exact countdown, so they go on time rather than a redispatch grace
    late. The task starts with a claim: one that finds the row moved on does nothing."""
    for pk, due, broadcast in messages_upcoming_qs(now).order_by("next_attempt_at").values_list(
        "pk", "next_attempt_at", "broadcast"
    )[:BATCH]:
        countdown = max(0.0, (due - now).total_seconds())
        if outbox_services.dispatch(pk, countdown=countdown, bulk=bool(broadcast)):
            report["messages_published_ahead"] += 1
    for pk, due in runs_upcoming_qs(now).order_by("next_attempt_at").values_list("pk", "next_attempt_at")[:BATCH]:
        if bot_services.dispatch_run(pk, countdown=max(0.0, (due - now).total_seconds())):
            report["runs_published_ahead"] += 1


def _sweeper_key() -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:sweeper:last-run"


def _record_last_run(finished: datetime) -> None:
    """When the last sweep finished: /readyz and /metrics show it, so a dead beat is seen."""
    if not settings.REDIS_URL:
        return
    import redis

    try:
        ratelimit.redis_client().set(_sweeper_key(), finished.timestamp())
    except redis.RedisError as exc:
        logger.warning("could not record the sweep's time: %s", exc)


def sweeper_last_run() -> datetime | None:
    """When a sweep last finished (any process), or None if unknown (never, or no Redis)."""
    if not settings.REDIS_URL:
        return None
    import redis

    try:
        value = ratelimit.redis_client().get(_sweeper_key())
    except redis.RedisError:
        return None
    return None if value is None else datetime.fromtimestamp(float(value), tz=UTC)


def _boundary_id(model: Any, field: str, cutoff: datetime) -> int | None:
    """The largest id whose `field` is before `cutoff`, by binary search on the primary
    key (ids grow with time): ~log2(n) index lookups, no index on `field` needed."""
    first = model.objects.order_by("pk").values_list("pk", field).first()
    if first is None or first[1] >= cutoff:
        return None
    lo = first[0]
    hi = model.objects.order_by("-pk").values_list("pk", flat=True).first()
    while lo < hi:
        mid = (lo + hi + 1) // 2
        row = model.objects.filter(pk__gte=mid).order_by("pk").values_list("pk", field).first()
        if row is not None and row[1] < cutoff:
            lo = row[0]  # >= mid: progress even across gaps in the ids
        else:
            hi = mid - 1
    return lo


def _retention_due() -> bool:
    """Retention is hourly work, not every tick's: the payload purge scans sent history.
    A Redis key with a TTL (SET NX EX) lets one sweep per interval do it; without Redis
    (the demo) or with Redis down, every sweep does."""
    interval = int(getattr(settings, "DOVECOTE_RETENTION_INTERVAL_SECONDS", 3600))
    if interval <= 0 or not settings.REDIS_URL:
        return True
    import redis

    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
        key = f"{getattr(settings, 'DOVECOTE_REDIS_PREFIX', '')}dovecote:sweeper:retention"
        return bool(client.set(key, "1", nx=True, ex=interval))
    except redis.RedisError:
        return True


def _retention(now: datetime, report: dict[str, int]) -> None:
    if not _retention_due():
        return
    report["payloads_purged"] += outbox_services.outbound_messages_purge_payloads()
    report["idempotency_records_pruned"] += idempotency_records_prune()
    # Never under Telegram's 24 hours of update redelivery: a pruned dedupe row would let
    # a redelivered update in twice.
    days = max(1, int(settings.DOVECOTE_LEDGER_RETENTION_DAYS))
    cutoff = now - timedelta(days=days)
    ids = _ids(effects_prunable_qs(cutoff), "created_at", PRUNE_BATCH)
    if ids:
        report["effects_pruned"] += Effect.objects.filter(pk__in=ids).delete()[1].get("outbox.Effect", 0)
    keep = int(getattr(settings, "DOVECOTE_OUTBOX_RETENTION_DAYS", 0))
    if keep > 0:
        # Never under the ledger's retention: a message's key must outlive the updates and
        # effects that could ask for it again.
        ids = _ids(messages_prunable_qs(now - timedelta(days=max(keep, days))), "updated_at", PRUNE_BATCH)
        if ids:
            deleted = OutboundMessage.objects.filter(pk__in=ids).delete()[1]
            report["messages_pruned"] += deleted.get("outbox.OutboundMessage", 0)
    boundary = _boundary_id(InboundUpdate, "received_at", cutoff)
    if boundary is not None:
        ids = _ids(updates_prunable_qs(cutoff, boundary), "pk", PRUNE_BATCH)
        if ids:
            deleted = InboundUpdate.objects.filter(pk__in=ids).delete()[1]
            report["updates_pruned"] += deleted.get("bots.InboundUpdate", 0)


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


STEPS = (
    _recover_inbox,
    _recover_runs,
    _recover_sends,
    _redispatch_sends,
    _publish_upcoming,
    _resume_bulk_retries,
    _retention,
)


def sweep() -> dict[str, int]:
    """One sweep; returns what it did. With another sweeper running: {"skipped": 1}."""
    report = dict.fromkeys(
        (
            "updates_redispatched",
            "updates_released",
            "runs_released",
            "runs_cancelled_too_old",
            "runs_redispatched",
            "messages_released",
            "messages_unknown",
            "messages_auto_resent",
            "messages_expired",
            "messages_probes",
            "messages_ramped",
            "messages_redispatched",
            "messages_published_ahead",
            "runs_published_ahead",
            "bulk_retries_resumed",
            "payloads_purged",
            "idempotency_records_pruned",
            "effects_pruned",
            "messages_pruned",
            "updates_pruned",
        ),
        0,
    )
    with sweep_lock() as got:
        if not got:
            logger.info("sweep skipped: another sweeper holds the lock")
            return {"skipped": 1}
        for step in STEPS:
            # Each step re-reads the clock: a long step must not make the next act on
            # a stale "now" (e.g. recovering a lease that was renewed meanwhile).
            step(timezone.now(), report)
        _record_last_run(timezone.now())
    done = {k: v for k, v in report.items() if v}
    if done:
        logger.info("sweep: %s", done, extra={"sweep": done})
    return report
