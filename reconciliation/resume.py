"""Resuming after PostgreSQL or Redis came back (core/workers.py OutageWatch calls `resume`),
rather than waiting for leases to run out and the sweeper's next tick.

1. `own_claims`: this process takes up the runs and sends it had claimed before the outage
   and holds no more, as the sweeper would at their lease's end.
2. `hand_on_waiting`, once per outage for all processes (a key in Redis decides which):
   routers, run tasks, drains and probes for what waits in the rows.

Everything handed on starts with a claim, so nothing is done twice. Why and how:
docs/DESIGN.md.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import redis
from django.conf import settings
from django.utils import timezone

from bots import transitions as bot_transitions
from bots.models import ConsumerRun, InboundUpdate, RunState, UpdateState
from bots.routing import inbox_router_wake
from bots.runs import dispatch_run
from core import connections, wakeups
from core.workers import lease_keeper, worker_id
from outbox import circuits, dispatch
from outbox import transitions as outbox_transitions
from outbox.models import Circuit, CircuitState, OutboundMessage, State
from outbox.sending import probe

logger = logging.getLogger(__name__)

# At most this many rows of each kind per pass: more is the sweeper's.
BATCH = 500
# The pass for all processes runs once within this long.
ONCE_MS = 3_000


def resume(since: float) -> dict[str, int]:
    """Take up this process's claims from before `since` (a time.time()), then, once for all
    processes, hand on what waits. Returns what it did."""
    before = datetime.fromtimestamp(since, tz=UTC)
    report = own_claims(before)
    if _first_to_resume():
        report.update(hand_on_waiting())
    logger.warning("resumed after an outage noted at %s: %s", before.isoformat(), report)
    return report


def own_claims(before: datetime) -> dict[str, int]:
    """Step 1: the runs and sends this process claimed before `before`."""
    worker = worker_id()
    # A run this process still holds is alive (awaiting a model on the event loop, or a
    # synchronous one between its database steps): the outage did not cut it off.
    alive = lease_keeper.held("run")
    runs = bot_transitions.release_own_runs(worker=worker, claimed_before=before, alive=alive)
    for pk in runs:
        dispatch_run(pk)
    sends = {"released": 0, "unknown": 0}
    released = []
    claimed = OutboundMessage.objects.filter(state=State.SENDING, lease_owner=worker, updated_at__lt=before)
    # So is a send whose request is still out here (its answer awaited by a batch or the
    # late-answers thread, outbox/sending/answers.py): released, it would turn unknown.
    claimed = claimed.exclude(pk__in=lease_keeper.held("send"))
    for pk in claimed.values_list("pk", flat=True)[:BATCH]:
        outcome = outbox_transitions.recover_expired_lease(pk, worker=worker, claimed_before=before)
        if outcome in sends:
            sends[outcome] += 1
        if outcome == "released":
            released.append(pk)
    dispatch.hand_on(released, drained=True)
    return {"runs_retried": len(runs), "sends_released": sends["released"], "sends_unknown": sends["unknown"]}


def _first_to_resume() -> bool:
    try:
        key = f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:resume"
        return bool(connections.shared_redis().set(key, b"1", nx=True, px=ONCE_MS))
    except redis.RedisError:
        return True  # Redis went again: better twice than not at all


def hand_on_waiting() -> dict[str, int]:
    """Step 2: routers for new updates, tasks for due runs, drains for due messages, probes
    for open circuits."""
    now = timezone.now()
    report = {"routers": 0, "runs_dispatched": 0, "drains": 0, "probes": 0}
    new = InboundUpdate.objects.filter(state=UpdateState.NEW, next_attempt_at__lte=now)
    for bot_id in new.order_by().values_list("bot_id", flat=True).distinct()[:BATCH]:
        wakeups.release(wakeups.key("router", bot_id))
        report["routers"] += bool(inbox_router_wake(bot_id))
    due_runs = ConsumerRun.objects.filter(state__in=[RunState.PENDING, RunState.RETRY], next_attempt_at__lte=now)
    for pk, consumer in due_runs.order_by("next_attempt_at").values_list("pk", "consumer")[:BATCH]:
        report["runs_dispatched"] += bool(dispatch_run(pk, consumer=consumer))
    due = OutboundMessage.objects.filter(state__in=[State.PENDING, State.RETRY], next_attempt_at__lte=now)
    for bot_id, broadcast in due.order_by().values_list("bot_id", "broadcast").distinct()[:BATCH]:
        if broadcast:
            wakeups.release(dispatch.bulk_drain_key(bot_id))
            report["drains"] += bool(dispatch.wake_bulk_drain(bot_id))
        else:
            wakeups.release(dispatch.drain_key(bot_id))
            report["drains"] += bool(dispatch.wake_drain(bot_id))
    for circuit in Circuit.objects.filter(
        scope__startswith=circuits.BOT_PREFIX, state__in=[CircuitState.OPEN, CircuitState.HALF_OPEN], manual=False
    ):
        parsed = circuits.parse_scope(circuit.scope)
        if parsed is None or circuit.next_probe_at is None:
            continue
        wakeups.release(probe.probe_key(int(parsed[1])))
        wait = max(0.0, (circuit.next_probe_at - now).total_seconds())
        report["probes"] += bool(probe.schedule_probe(int(parsed[1]), wait))
    return report
