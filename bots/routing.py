"""Routing: a bot's router takes its new updates a batch at a time, writes one consumer run
per matching consumer with each update's routed mark, runs the inline-safe runs here and
starts the awaiting ones on the event loop (bots/aio.py); the bot's wake-up key keeps one
router per bot, which lingers for the next update's nudge."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from bots import registry, transitions
from bots.models import Bot, ConsumerRun, InboundUpdate, RunState
from bots.runs import circuit_dirty, consumer_runs_execute_inline, dispatch_run, quiet_success
from core import rows, wakeups
from core.logs import current_trace_id
from core.publishing import publish
from core.workers import lease_keeper, worker_id
from outbox.models import Circuit
from outbox.selectors import consumer_scope

logger = logging.getLogger(__name__)


# The router routes a bot's new updates this many at a time, and hands the worker back
# (publishing its continuation) after this long, so a steady stream cannot hold it.
ROUTE_BATCH_SIZE = 50


ROUTE_TIME_BUDGET_SECONDS = 10.0


def dispatch_update(update_pk: int) -> bool:
    from bots.tasks import route_update

    return publish(route_update, (update_pk,), what=f"update {update_pk}")


def inbox_update_route(update_pk: int) -> list[int]:
    """Route one update (the sweeper's redispatch, and the demo's per-update task): its
    consumer runs written and the update marked routed together; the runs dispatched, or run
    here (inline-safe consumers). Routing is decided once and recorded. Returns the runs' ids."""
    routed, routing = _route(transitions.updates_to_route(update_pk=update_pk, limit=1))
    _run_inline_and_log(routed, routing)
    return [pk for pk, _, _ in routing.runs]


def inbox_updates_route(bot_id: int, *, limit: int = ROUTE_BATCH_SIZE) -> int:
    """Route up to `limit` of the bot's new updates, oldest first: their runs written and the
    updates marked routed in one statement, then the inline-safe runs run here. Updates a
    router on another worker routed first are left to it. Returns how many it routed."""
    circuits = _inline_circuits() if settings.DOVECOTE_INLINE_WORK else None
    routed, routing = _route(transitions.updates_to_route(bot_id=bot_id, limit=limit, circuits=circuits))
    _run_inline_and_log(routed, routing)
    return len(routed)


@dataclass(frozen=True)
class Routing:
    """The runs of just-routed updates: (run id, update id, consumer), and those to run here
    (their rows as written, ready to run)."""

    runs: list[tuple[int, int, str]]
    inline: list[ConsumerRun]
    awaiting: list[ConsumerRun] = field(default_factory=list)


def _route(updates: list[InboundUpdate]) -> tuple[list[InboundUpdate], Routing]:
    """One ConsumerRun per matching consumer of each update, written as the update is marked
    routed (transitions.route). Returns the updates routed here (not those another router
    took first) and their runs. The runs of inline-safe consumers (registry.consumer) are
    left for the caller to run; those whose consumer's circuit is plainly closed and whose
    update is not past the consumer's max age are written already claimed by this worker
    (running, its lease, one attempt), so running them needs no claim. The others are
    dispatched once written."""
    if not updates:
        return [], Routing([], [])
    now = timezone.now()
    matched = {u.pk: registry.matching(u) for u in updates}
    inline_work = settings.DOVECOTE_INLINE_WORK
    inline_keys = {(u.pk, spec.name) for u in updates for spec in matched[u.pk] if inline_work and spec.runs_inline(u)}
    claimed_now = _claimable_inline(updates, matched, inline_keys, now=now)
    worker = worker_id()
    lease_until = now + timedelta(seconds=settings.DOVECOTE_CONSUMER_LEASE_SECONDS)
    runs = {
        (u.pk, spec.name): rows.new(
            ConsumerRun,
            update=u,
            bot_id=u.bot_id,
            consumer=spec.name,
            max_attempts=spec.max_attempts,
            next_attempt_at=now,
            trace_id=u.trace_id,
            **(
                {"state": RunState.RUNNING, "lease_owner": worker, "lease_expires_at": lease_until, "attempts": 1}
                if (u.pk, spec.name) in claimed_now
                else {}
            ),
        )
        for u in updates
        for spec in matched[u.pk]
    }
    routed_ids = transitions.route(updates, list(runs.values()))
    ours = {key: run for key, run in runs.items() if key[0] in routed_ids}
    if all(run.pk is not None for run in ours.values()):
        routed = sorted((run.pk, update_pk, name) for (update_pk, name), run in ours.items())
    else:
        # Runs of these updates existed already (nothing routes an update twice; this is for
        # rows written by hand): they are the runs, as they stand.
        routed = list(
            ConsumerRun.objects.filter(update__in=routed_ids).order_by("pk").values_list("pk", "update_id", "consumer")
        )
    inline = [runs[(u, name)] for pk, u, name in routed if (u, name) in inline_keys and runs[(u, name)].pk == pk]
    # Awaiting runs (a model) start on this worker's event loop once committed (bots/aio.py).
    by_update = {u.pk: u for u in updates}
    awaiting = [
        runs[(u, name)]
        for pk, u, name in routed
        if (u, name) not in inline_keys
        and runs[(u, name)].pk == pk
        and (spec := registry.get(name)) is not None
        and spec.runs_async(by_update[u])
    ]
    started_here = {run.pk for run in inline} | {run.pk for run in awaiting}
    queued = [(pk, name) for pk, _, name in routed if pk not in started_here]
    transaction.on_commit(lambda: [dispatch_run(pk, consumer=name) for pk, name in queued])
    return [u for u in updates if u.pk in routed_ids], Routing(routed, inline, awaiting)


def _inline_circuits() -> list[str]:
    """The circuit scopes of the consumers that may run inline: read with the updates."""
    return sorted(consumer_scope(spec.name) for spec in registry.registered().values() if spec.inline)


def _claimable_inline(
    updates: list[InboundUpdate],
    matched: dict[int, list[registry.ConsumerSpec]],
    inline_keys: set[tuple[int, str]],
    *,
    now: datetime,
) -> set[tuple[int, str]]:
    """The inline runs to write already claimed: their consumer's circuit plainly closed (one
    read for the batch's consumers) and their update within the consumer's max age. The rest
    take the checks of `consumer_runs_execute_inline`."""
    if not inline_keys:
        return set()
    specs = {spec.name: spec for u in updates for spec in matched[u.pk]}
    names = {name for _, name in inline_keys}
    scopes = {consumer_scope(name) for name in names}
    read = getattr(updates[0], "unsettled_circuits", None)  # read with the updates (transitions)
    if read is not None:
        unsettled = set(read) & scopes
    else:
        unsettled = {c.scope for c in Circuit.objects.filter(scope__in=scopes) if circuit_dirty(c)}
    received = {u.pk: u.received_at for u in updates}
    return {
        (update_pk, name)
        for update_pk, name in inline_keys
        if consumer_scope(name) not in unsettled and received[update_pk] >= now - specs[name].max_age
    }


def _run_inline_and_log(updates: list[InboundUpdate], routing: Routing) -> None:
    """Run the inline-safe runs in this task, after the routing commit (each is a committed
    row first, so a router that dies here leaves them for the sweeper), then log one line
    per update: where it went and what ran here (a run's failure logs its own)."""
    if routing.awaiting:
        _start_awaiting(routing.awaiting)
    token = quiet_success.set(True)
    try:
        with lease_keeper.holding("run", [run.pk for run in routing.inline]):
            outcomes = consumer_runs_execute_inline(routing.inline) if routing.inline else {}
    finally:
        quiet_success.reset(token)
    by_update: dict[int, list[tuple[int, str]]] = {}
    for pk, update_pk, name in routing.runs:
        by_update.setdefault(update_pk, []).append((pk, name))
    for u in updates:
        runs = by_update.get(u.pk, [])
        names = [name for _, name in runs]
        here = ", ".join(f"{name} {outcomes[pk]}" for pk, name in runs if pk in outcomes)
        current_trace_id.set(u.trace_id)
        logger.info(
            "update %s routed to %s%s",
            u.update_id,
            ", ".join(names) or "no consumer",
            f"; ran here: {here}" if here else "",
            extra={"consumers": names},
        )


def _start_awaiting(runs: list[ConsumerRun]) -> None:
    """Start the router's awaiting runs on this worker's event loop (bots/aio.py), waiting
    for room there up to the router's time budget; those that find none, or whose consumer's
    circuit is not plainly closed, get a task each (another worker's loop may have room)."""
    from bots import aio

    bots: dict[int, Bot] = {}
    for run in runs:
        # The loop's runs must not touch the database on their own: their bot loaded here.
        bot = bots.get(run.update.bot_id) or bots.setdefault(run.update.bot_id, run.update.bot)
        run.update.bot = bot
    for run in aio.start_routed(runs, timeout=ROUTE_TIME_BUDGET_SECONDS):
        dispatch_run(run.pk, consumer=run.consumer)


def _router_key(bot_id: int) -> str:
    return wakeups.key("router", bot_id)


def inbox_router_wake(bot_id: int, update_pk: int | None = None) -> bool:
    """Have a router of this bot run unless one is queued or running (core/wakeups.py): a
    burst of updates at the webhook publishes one task. Never raises. Without the wake-up
    key (Redis failing) the update gets a routing task of its own; when the
    broker is down too, it stays new in its row and the sweeper dispatches it."""
    return _router_wake_for(bot_id, [update_pk] if update_pk is not None else [])


def _router_wake_for(bot_id: int, update_pks: list[int]) -> bool:
    """inbox_router_wake for several updates of one bot (the webhook's wake-up thread runs
    one per round): one router for all of them, or a routing task for each."""
    woken = wakeups.wake(_router_key(bot_id), lambda: _publish_router(bot_id), nudge=True)
    if woken is None:
        dispatched = [dispatch_update(pk) for pk in update_pks]  # every one, past a failure too
        return bool(dispatched) and all(dispatched)
    return woken


def _router_nudge(bot_id: int, update_pk: int) -> bool | None:
    """The webhook's wake-up in the request's thread when its process is quiet: a nudge for the
    bot's router when one holds the key (a steady stream keeps one lingering); else the
    wake-up thread publishes one (or falls back, when Redis failed)."""
    return wakeups.nudge_if_held(_router_key(bot_id))


_router_wake_soon = wakeups.Deferred(_router_wake_for, at_once=_router_nudge)


def inbox_router_wake_soon(bot_id: int, update_pk: int) -> None:
    """inbox_router_wake left to this process's wake-up thread (the webhook's): the request
    does not wait on Redis or the broker."""
    _router_wake_soon.add(bot_id, update_pk)


def inbox_router_wakes_flush(timeout: float = 2.0) -> bool:
    """Hand over the wake-ups still waiting in this process (a web worker about to exit)."""
    return _router_wake_soon.flush(timeout)


def _publish_router(bot_id: int) -> bool:
    from bots.tasks import route_bot

    return publish(route_bot, (bot_id,), what=f"router of bot {bot_id}")


def inbox_router_run(bot_id: int, *, linger: bool = False) -> int:
    """The router task: route the bot's new updates a batch at a time until none is left or
    the time budget is spent (then a continuation follows). It holds the bot's wake-up key
    while it runs; it lets go of it when a batch comes back empty, then looks once more, so
    an update stored while the key was still held is never left without a router.

    `linger` (a worker's task): before letting go, wait with the key for the next update's
    nudge (DOVECOTE_ROUTER_LINGER_SECONDS, unless other tasks wait for a worker), so a
    steady stream of updates is routed without a publish and a worker's hop for each."""
    started = renewed = time.monotonic()  # the wake-up that published this task set the key
    key = _router_key(bot_id)
    busy_queues = _router_linger_queues() if linger else None
    routed = 0
    holds_key = True
    while True:
        if holds_key and time.monotonic() - renewed > wakeups.RENEW_AFTER_SECONDS:
            wakeups.renew(key)
            renewed = time.monotonic()
        n = inbox_updates_route(bot_id, limit=ROUTE_BATCH_SIZE)
        routed += n
        if n == 0 and not holds_key:
            return routed  # the look after letting go (one statement when, as usual, it is empty)
        left = ROUTE_TIME_BUDGET_SECONDS - (time.monotonic() - started)
        if n < ROUTE_BATCH_SIZE and holds_key:
            # Nothing more was waiting when it looked: wait for a nudge, or let go of the key
            # and look once more.
            seconds = min(settings.DOVECOTE_ROUTER_LINGER_SECONDS, left)
            if busy_queues is not None and seconds > 0 and wakeups.await_nudge(key, seconds, busy_queues):
                renewed = time.monotonic()
                continue
            wakeups.release(key)
            holds_key = False
        if time.monotonic() - started > ROUTE_TIME_BUDGET_SECONDS:
            wakeups.hand_over(key, lambda: _publish_router(bot_id), holds_key=holds_key)
            return routed


def _router_linger_queues() -> list[str] | None:
    """The broker's lists a lingering router watches (it hands its worker back when a task
    waits in one), or None when it cannot see them and so must not linger: the broker is not
    the Redis of the wake-up keys (RabbitMQ, or a Redis of its own)."""
    if settings.DOVECOTE_ROUTER_LINGER_SECONDS <= 0:
        return None
    if settings.CELERY_BROKER_URL != settings.REDIS_URL:
        return None
    prefix = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("global_keyprefix", "")
    return [prefix + settings.CELERY_TASK_DEFAULT_QUEUE, prefix + settings.CELERY_TASK_QUEUE_BULK]
