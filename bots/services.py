"""Inbox services: store an update, route it to consumers, run a consumer."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from django.utils import timezone

from bots import registry, transitions
from bots.models import Bot, ConsumerRun, InboundUpdate, RunState
from core import metrics, rows, wakeups
from core.failpoints import failpoint
from core.ids import time_ordered_id
from core.logs import current_trace_id
from core.publishing import publish
from core.workers import lease_keeper, worker_id
from outbox import circuits
from outbox import dispatch as outbox_dispatch
from outbox.models import Circuit, CircuitState, DeadLetter
from outbox.sending import single

logger = logging.getLogger(__name__)

# Update fields that carry a message-like object with a chat.
_MESSAGE_TYPES = (
    "message",
    "edited_message",
    "channel_post",
    "edited_channel_post",
    "business_message",
    "edited_business_message",
)


def new_trace_id() -> str:
    """The id that follows an update through its runs, messages, dead letters and log lines:
    time-ordered, so the hot tables' trace_id indexes grow at one edge (core/ids.py)."""
    return time_ordered_id()


def describe_update(payload: dict[str, Any]) -> dict[str, Any]:
    """The indexed fields of an Update: its type, chat, user and message id."""
    update_type = next((k for k in payload if k != "update_id"), "")
    body = payload.get(update_type) if update_type else None
    fields: dict[str, Any] = {"update_type": update_type[:40]}
    if not isinstance(body, dict):
        return fields
    message = body if update_type in _MESSAGE_TYPES else body.get("message")
    chat = (message or {}).get("chat") if isinstance(message, dict) else None
    if not isinstance(chat, dict):
        chat = body.get("chat") if isinstance(body.get("chat"), dict) else None
    sender = body.get("from") if isinstance(body.get("from"), dict) else None
    if isinstance(chat, dict) and _int64(chat.get("id")) is not None:
        fields["chat_id"] = _int64(chat.get("id"))
        fields["chat_type"] = str(chat.get("type", ""))[:20]
    if isinstance(sender, dict):
        fields["user_id"] = _int64(sender.get("id"))
    if isinstance(message, dict):
        fields["message_id"] = _int64(message.get("message_id"))
    return fields


def _int64(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    return None


# The webhook's bot, per process, for this long: a burst of updates does not look the bot
# up once per update. A change saved in this process forgets it at once (`forget_bot`);
# other processes see a deactivation or a new secret within this time.
BOT_CACHE_SECONDS = 5.0
_bots: dict[str, tuple[float, Bot]] = {}


def webhook_bot(name: str) -> Bot | None:
    """The active bot of this name, from the per-process cache when fresh."""
    cached = _bots.get(name)
    now = time.monotonic()
    if cached is not None and cached[0] > now:
        return cached[1]
    bot = Bot.objects.filter(name=name, is_active=True).first()
    if bot is None:
        # Unknown names are not cached: a scanner's made-up names must not fill memory.
        _bots.pop(name, None)
        return None
    _bots[name] = (now + BOT_CACHE_SECONDS, bot)
    return bot


@receiver([post_save, post_delete], sender=Bot, dispatch_uid="bots.forget_bot")
def forget_bot(sender: Any = None, instance: Bot | None = None, **kwargs: Any) -> None:
    """Drop the cached webhook bots (all of them: a renamed bot's old name too)."""
    _bots.clear()


def inbox_update_store(
    *, bot: Bot, payload: dict[str, Any], trace_id: str | None = None, wake_soon: bool = False
) -> tuple[InboundUpdate, bool]:
    """Insert the update once per (bot, update_id) and dispatch its routing after commit.
    Returns (update, created); a duplicate reads the row that was stored first. `wake_soon`:
    the router's wake-up is left to this process's wake-up thread."""
    trace_id = trace_id or new_trace_id()
    values = _update_values(bot, payload, trace_id)
    pk = _update_insert(bot, values, wake_soon=wake_soon)
    if pk is None:
        return InboundUpdate.objects.get(bot=bot, update_id=payload["update_id"]), False
    del values["bot_id"]
    row = InboundUpdate(pk=pk, bot=bot, **values)
    row._state.adding, row._state.db = False, DEFAULT_DB_ALIAS
    return row, True


def inbox_update_receive(*, bot: Bot, payload: dict[str, Any], body: str | None, trace_id: str) -> tuple[bool, str]:
    """The webhook's hot path: one statement (INSERT ... ON CONFLICT DO NOTHING RETURNING id,
    no model instance, `body` stored as it came when given), the router's wake-up left to
    this process's wake-up thread so the answer does not wait on Redis or the broker.
    Returns (stored: False for a duplicate, the update's type)."""
    values = _update_values(bot, payload, trace_id)
    if body is not None:
        values["payload"] = rows.JSONText(body)
    return _update_insert(bot, values, wake_soon=True) is not None, values["update_type"]


def _update_values(bot: Bot, payload: dict[str, Any], trace_id: str) -> dict[str, Any]:
    now = timezone.now()
    return {
        "bot_id": bot.pk,
        "update_id": payload["update_id"],
        "payload": payload,
        "trace_id": trace_id,
        "next_attempt_at": now,
        "received_at": now,
        **describe_update(payload),
    }


def _update_insert(bot: Bot, values: dict[str, Any], *, wake_soon: bool = False) -> int | None:
    """Write the update's row unless (bot, update_id) is stored; have a router woken after
    the commit. The new row's pk, or None for a duplicate."""
    pk = rows.insert_values_once(InboundUpdate, values, unique=("bot_id", "update_id"))
    if pk is None:
        return None
    wake = _router_wake_soon.add if wake_soon else inbox_router_wake
    transaction.on_commit(lambda: wake(bot.pk, pk))  # at once in autocommit (the webhook)
    return pk


def dispatch_update(update_pk: int) -> bool:
    from bots.tasks import route_update

    return publish(route_update, (update_pk,), what=f"update {update_pk}")


# A run's worker still stuck this long after the soft limit interrupted its consumer (a call
# that ignores the interruption) is ended by Celery's hard limit; its lease then runs out.
HARD_LIMIT_GRACE_SECONDS = 30.0


def dispatch_run(run_pk: int, *, countdown: float = 0.0, consumer: str | None = None) -> bool:
    """Publish the run's task with its consumer's time limits: the soft limit interrupts the
    consumer (a failed attempt, see consumer_run_execute); the hard one, a grace later, ends
    a worker stuck past it, whose run the sweeper then recovers once its lease runs out."""
    from bots.tasks import run_consumer
    from outbox.policy import MAX_BROKER_COUNTDOWN_SECONDS

    if countdown > MAX_BROKER_COUNTDOWN_SECONDS:
        return False  # the sweeper dispatches it when due
    if consumer is None:
        consumer = ConsumerRun.objects.filter(pk=run_pk).values_list("consumer", flat=True).first()
    spec = registry.get(consumer) if consumer else None
    limits = {}
    if spec is not None:
        limits = {
            "soft_time_limit": spec.time_limit(),
            "time_limit": spec.time_limit() + HARD_LIMIT_GRACE_SECONDS,
        }
    return publish(run_consumer, (run_pk,), countdown=countdown, what=f"consumer run {run_pk}", **limits)


# The router routes a bot's new updates this many at a time, and hands the worker back
# (publishing its continuation) after this long, so a steady stream cannot hold it.
ROUTE_BATCH_SIZE = 50
ROUTE_TIME_BUDGET_SECONDS = 10.0


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
    return sorted(circuits.consumer_scope(spec.name) for spec in registry.registered().values() if spec.inline)


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
    scopes = {circuits.consumer_scope(name) for name in names}
    read = getattr(updates[0], "unsettled_circuits", None)  # read with the updates (transitions)
    if read is not None:
        unsettled = set(read) & scopes
    else:
        unsettled = {c.scope for c in Circuit.objects.filter(scope__in=scopes) if _circuit_dirty(c)}
    received = {u.pk: u.received_at for u in updates}
    return {
        (update_pk, name)
        for update_pk, name in inline_keys
        if circuits.consumer_scope(name) not in unsettled and received[update_pk] >= now - specs[name].max_age
    }


def _run_inline_and_log(updates: list[InboundUpdate], routing: Routing) -> None:
    """Run the inline-safe runs in this task, after the routing commit (each is a committed
    row first, so a router that dies here leaves them for the sweeper), then log one line
    per update: where it went and what ran here (a run's failure logs its own)."""
    if routing.awaiting:
        _start_awaiting(routing.awaiting)
    token = _quiet_success.set(True)
    try:
        with lease_keeper.holding("run", [run.pk for run in routing.inline]):
            outcomes = consumer_runs_execute_inline(routing.inline) if routing.inline else {}
    finally:
        _quiet_success.reset(token)
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


# Set while the router runs inline runs: their successes are told in its one line per update.
_quiet_success: ContextVar[bool] = ContextVar("dovecote_quiet_success", default=False)


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


def consumer_run_execute(run_pk: int) -> str:
    """Run one consumer on one update. Safe to call any number of times: it starts with a
    claim, and what the consumer does goes through stable keys. Counted by its outcome."""
    consumer = "unknown"

    def named(name: str) -> None:
        nonlocal consumer
        consumer = name

    with lease_keeper.holding("run", [run_pk]):
        if not settings.DOVECOTE_INLINE_WORK:
            outcome = _consumer_run_execute(run_pk, named)
        else:
            # The replies this run writes go out from this worker right after their commit.
            held: list[tuple[int, int]] = []
            try:
                with outbox_dispatch.holding() as held:
                    outcome = _consumer_run_execute(run_pk, named)
            finally:
                single.send_held(held)
    if outcome != "started":  # an awaiting run counts its own outcome (bots/aio.py)
        metrics.CONSUMER_RUNS.labels(consumer=consumer, outcome=outcome).inc()
    return outcome


def _consumer_run_execute(run_pk: int, named: Callable[[str], None]) -> str:
    run = ConsumerRun.objects.select_related("update", "update__bot").filter(pk=run_pk).first()
    if run is None or run.state not in transitions.RUN_WAITING:
        return "not-waiting"
    current_trace_id.set(run.trace_id)
    spec = registry.get(run.consumer)
    if spec is None:
        transitions.cancel_run(run.pk, reason=f"no consumer named {run.consumer!r} is registered")
        return "unknown-consumer"
    named(spec.name)
    now = timezone.now()
    if run.next_attempt_at > now:
        # Delivered early (a broker countdown is not exact): come back when due.
        dispatch_run(run.pk, countdown=(run.next_attempt_at - now).total_seconds(), consumer=spec.name)
        return "not-due"
    if run.update.received_at < now - spec.max_age:
        consumer_run_end_stale(run, spec=spec)
        return "too-old"
    scope = circuits.consumer_scope(spec.name)
    circuit = Circuit.objects.filter(scope=scope).first()
    if circuit is not None and _still_open(circuit, now):
        # Paused (auth failure or an operator): keep the run; wake it at the probe time.
        if circuit.next_probe_at is not None:
            transitions.postpone_run(run.pk, until=circuit.next_probe_at)
        return "circuit-open"

    worker = worker_id()
    lease = timedelta(seconds=settings.DOVECOTE_CONSUMER_LEASE_SECONDS)
    if spec.runs_async(run.update):
        return _start_awaiting_one(run, spec, worker=worker, lease=lease, circuit_dirty=_circuit_dirty(circuit))
    if not transitions.claim_run(run.pk, worker=worker, lease=lease):
        return "claimed-elsewhere"
    outcome, returned = _attempt(run, spec, worker=worker)
    if outcome != "done":
        return outcome
    if _circuit_dirty(circuit):
        circuits.record_success(scope)
    transitions.mark_run_done(run.pk, worker=worker, outcome=returned)
    if not _quiet_success.get():
        logger.info("consumer %s done on update %s: %s", spec.name, run.update.update_id, returned)
    return "done"


# A run's task waits this long for room on its worker's event loop, then hands the run to
# another task (a worker with room takes it).
AWAITING_ROOM_WAIT_SECONDS = 10.0


def _start_awaiting_one(
    run: ConsumerRun, spec: registry.ConsumerSpec, *, worker: str, lease: timedelta, circuit_dirty: bool
) -> str:
    """A run's task for an awaiting consumer: claim it and start it on this worker's event
    loop (bots/aio.py); the task returns at once, the run settles itself there."""
    from bots import aio

    if not aio.take_slots(1, timeout=AWAITING_ROOM_WAIT_SECONDS):
        dispatch_run(run.pk, consumer=spec.name)
        return "no-room"
    if not transitions.claim_run(run.pk, worker=worker, lease=lease):
        aio.release_slots(1)
        return "claimed-elsewhere"
    run.attempts += 1
    aio.start(run, spec, worker=worker, circuit_dirty=circuit_dirty)
    return "started"


def consumer_runs_execute_inline(runs: list[ConsumerRun]) -> dict[int, str]:
    """The router's inline runs of one batch, just routed and committed: the single run's
    rules at a batch's price. Claimed together, each consumer run for all its runs at once (a
    failure settled for its run alone), its replies sent before the next consumer runs, the
    successes marked done in one statement; a run whose consumer's circuit is not plainly closed
    takes the single path. Returns each run's outcome. A crash mid-batch leaves the runs
    `running` for the sweeper; stable keys keep a second run from writing twice."""
    outcomes: dict[int, str] = {}
    now = timezone.now()
    worker = worker_id()
    specs = {run.pk: registry.get(run.consumer) for run in runs}
    # Written already claimed by this worker (`_route`): checked there, nothing to claim.
    claimed = {run.pk: run.attempts for run in runs if run.state == RunState.RUNNING and run.lease_owner == worker}
    scopes = {
        circuits.consumer_scope(spec.name) for pk, spec in specs.items() if spec is not None and pk not in claimed
    }
    # Usually none: the runs were written claimed (no queryset to build for an empty IN).
    unsettled = {c.scope for c in Circuit.objects.filter(scope__in=scopes) if _circuit_dirty(c)} if scopes else set()
    ready: list[ConsumerRun] = []
    for run in runs:
        spec = specs[run.pk]
        if run.pk in claimed:
            ready.append(run)
        elif spec is None or circuits.consumer_scope(spec.name) in unsettled:
            outcomes[run.pk] = consumer_run_execute(run.pk)
        elif run.update.received_at < now - spec.max_age:
            current_trace_id.set(run.trace_id)
            consumer_run_end_stale(run, spec=spec)
            outcomes[run.pk] = _counted(spec.name, "too-old")
        else:
            ready.append(run)
    lease = timedelta(seconds=settings.DOVECOTE_CONSUMER_LEASE_SECONDS)
    claimed.update(
        transitions.claim_runs([run.pk for run in ready if run.pk not in claimed], worker=worker, lease=lease)
    )
    held: list[tuple[int, int]] = []
    done: dict[int, str] = {}
    bots = {run.bot_id: run.update.bot for run in ready[:1]}  # a router's batch has one bot
    groups: dict[str, list[ConsumerRun]] = {}
    for run in ready:
        if run.pk in claimed:
            run.attempts = claimed[run.pk] - 1  # the attempt about to run counts once it does
            groups.setdefault(run.consumer, []).append(run)
        else:
            outcomes[run.pk] = _counted(specs[run.pk].name, "claimed-elsewhere")
    try:
        for name, group in groups.items():
            with outbox_dispatch.holding() as held:
                attempted = _attempt_all(group, registry.get(name), worker=worker)
            for run, (outcome, returned) in zip(group, attempted, strict=True):
                if outcome == "done":
                    done[run.pk] = returned
                outcomes[run.pk] = outcome
            failpoint("after_inline_runs")  # a consumer's runs run, their replies committed, not sent
            # A consumer's replies go before the next consumer runs (the answer does not wait
            # for the analytics), a batch of sends at a time; what cannot go now is handed to
            # the bot's drain.
            single.send_held(held, bots=bots)
            held = []
    finally:
        # What a failure left unsent first (it is committed; the answer should not wait for
        # bookkeeping), then the runs marked done: a crash between them re-runs the runs,
        # whose replies' keys are taken, so nothing is sent twice.
        single.send_held(held, bots=bots)
        transitions.mark_runs_done(done, worker=worker)
    for run in ready:
        if run.pk in claimed:
            _counted(specs[run.pk].name, outcomes[run.pk])
    return outcomes


def _attempt_all(runs: list[ConsumerRun], spec: registry.ConsumerSpec, *, worker: str) -> list[tuple[str, str]]:
    """`_attempt` for several claimed runs of one consumer: in one call of its batch form
    when it has one (registry.consumer's `batch`), else one by one. A batch that declines
    (None), raises, or answers for the wrong number of runs settles nothing: each run is
    then tried alone, and a failure is settled for its own run."""
    if spec.batch is None or len(runs) < 2:
        return [_attempt_traced(run, spec, worker=worker) for run in runs]
    ctxs = [
        registry.ConsumerContext(update=run.update, consumer=spec.name, trace_id=run.trace_id, attempt=run.attempts + 1)
        for run in runs
    ]
    try:
        answered = spec.batch(ctxs)
        if answered is None:
            # Declined before doing anything (a run that may defer): each runs alone.
            return [_attempt_traced(run, spec, worker=worker) for run in runs]
        returned = list(answered)
        if len(returned) != len(runs):
            raise ValueError(f"its batch answered for {len(returned)} of {len(runs)} runs")
    except Exception as exc:  # noqa: BLE001 - each run then has its own attempt
        logger.warning(
            "consumer %s: a batch of %s runs failed (%s); running them one by one", spec.name, len(runs), _describe(exc)
        )
        return [_attempt_traced(run, spec, worker=worker) for run in runs]
    for run in runs:
        run.attempts += 1
    return [("done", value if isinstance(value, str) else "done") for value in returned]


def _attempt_traced(run: ConsumerRun, spec: registry.ConsumerSpec, *, worker: str) -> tuple[str, str]:
    current_trace_id.set(run.trace_id)
    return _attempt(run, spec, worker=worker)


def _counted(consumer: str, outcome: str) -> str:
    metrics.CONSUMER_RUNS.labels(consumer=consumer, outcome=outcome).inc()
    return outcome


def _circuit_dirty(circuit: Circuit | None) -> bool:
    """A circuit that is not plainly closed: a success must be written to it (it forgets the
    counted failures, or closes it), and an open one may hold the run."""
    return circuit is not None and not (circuit.state == CircuitState.CLOSED and circuit.consecutive_failures == 0)


def _attempt(run: ConsumerRun, spec: registry.ConsumerSpec, *, worker: str) -> tuple[str, str]:
    """Call the consumer on the run this worker has just claimed. A failure is settled here:
    a deferral, an auth pause, a retry with backoff or a dead letter. Returns ("done", what
    the consumer returned) for the caller to mark done, or (the outcome, "")."""
    run.attempts += 1
    ctx = registry.ConsumerContext(update=run.update, consumer=spec.name, trace_id=run.trace_id, attempt=run.attempts)
    try:
        if spec.async_func is spec.func:
            # An `async def` consumer without the event loop's runs (DOVECOTE_ASYNC_CONCURRENCY
            # 0): this task waits for it on the process's loop.
            from bots import aio

            returned = aio.wait_for(spec.func(ctx))
        else:
            returned = spec.func(ctx)
    except Exception as exc:  # noqa: BLE001 - a consumer's failure must not stop the others
        return consumer_run_settle_failure(run, spec, exc, worker=worker), ""
    return "done", returned if isinstance(returned, str) else "done"


def consumer_run_settle_failure(
    run: ConsumerRun, spec: registry.ConsumerSpec, exc: BaseException, *, worker: str
) -> str:
    """What a claimed run's failed attempt comes to, settled: a deferral, an auth pause, a
    retry with backoff or a dead letter (the one place for both the Celery task's runs and
    the event loop's, bots/aio.py). Returns the outcome."""
    if isinstance(exc, registry.Defer):
        transitions.defer_run(run.pk, worker=worker, until=exc.until, reason=exc.reason)
        dispatch_run(run.pk, countdown=max(0.0, (exc.until - timezone.now()).total_seconds()), consumer=spec.name)
        return "deferred"
    if isinstance(exc, registry.AuthError):
        delay = circuits.open_for_auth(circuits.consumer_scope(spec.name), reason=str(exc))
        transitions.schedule_run_retry(
            run.pk, worker=worker, delay=delay, error=str(exc), error_class="auth", free=True
        )
        logger.warning("consumer %s paused (auth) on update %s: %s", spec.name, run.update.update_id, exc)
        dispatch_run(run.pk, countdown=delay, consumer=spec.name)
        return "paused"
    if isinstance(exc, registry.PermanentError):
        error = _describe(exc)
        _dead_letter_run(
            run,
            lambda: transitions.fail_run(run.pk, worker=worker, error=error, error_class="permanent"),
            error=error,
            error_class="permanent",
        )
        logger.warning("consumer %s dead-lettered update %s: %s", spec.name, run.update.update_id, error)
        return "dead-lettered"
    # Celery's soft time limit lands here too (SoftTimeLimitExceeded, raised wherever the
    # consumer was), and an awaiting run's asyncio.timeout (registry.TimedOut): a failed attempt
    # like any other, named for what it was.
    error = (
        f"timed out: still running after the consumer's time limit of {spec.time_limit():g}s"
        if isinstance(exc, SoftTimeLimitExceeded | registry.TimedOut)
        else _describe(exc)
    )
    logger.warning(
        "consumer %s failed on update %s (attempt %s of %s): %s",
        spec.name,
        run.update.update_id,
        run.attempts,
        run.max_attempts,
        error,
    )
    if run.attempts >= run.max_attempts:
        _dead_letter_run(
            run,
            lambda: transitions.fail_run(run.pk, worker=worker, error=error, error_class="exhausted"),
            error=error,
            error_class="exhausted",
        )
        return "dead-lettered"
    delay = spec.delay_after(run.attempts)
    transitions.schedule_run_retry(run.pk, worker=worker, delay=delay, error=error, error_class="transient")
    dispatch_run(run.pk, countdown=delay, consumer=spec.name)
    return "retry"


def _still_open(circuit: Circuit, now: datetime) -> bool:
    """The circuit is open and not yet due for a probe."""
    return circuit.state == CircuitState.OPEN and (circuit.next_probe_at is None or circuit.next_probe_at > now)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _dead_letter_run(run: ConsumerRun, transition: Callable[[], bool], *, error: str, error_class: str) -> bool:
    """Take the run to failed with `transition` and write its dead letter, in one transaction:
    no failed run without a letter, no letter for a run another worker moved on."""
    with transaction.atomic():
        if not transition():
            return False
        DeadLetter.objects.create(
            bot_id=run.bot_id,
            consumer_run=run,
            consumer=run.consumer,
            reason_class=error_class,
            first_error=run.last_error or error,
            last_error=error,
            trace_id=run.trace_id,
            chat_id=run.update.chat_id,
            idempotency_key=f"upd:{run.update.update_id}:{run.consumer}",
        )
    metrics.DEAD_LETTERS.labels(kind="consumer_run", reason=error_class).inc()
    return True


LOST_RUN_ERROR = "worker lost: it stopped renewing the run's lease of {lease}s (died, or stuck past its time limit)"


def consumer_run_recover_expired(run_pk: int) -> str:
    """A run still `running` past its lease: its worker died, was killed or hung. The claim
    counted that attempt and it failed, so it is charged like any failure: with budget left
    the run is retried after its consumer's backoff ("released"); with the budget spent it
    goes to the dead letters with reason `exhausted` ("dead-lettered"), never back to the
    queue. "" when the run was not (or no longer) expired."""
    run = ConsumerRun.objects.select_related("update").filter(pk=run_pk).first()
    if run is None:
        return ""
    current_trace_id.set(run.trace_id)
    error = LOST_RUN_ERROR.format(lease=settings.DOVECOTE_CONSUMER_LEASE_SECONDS)
    if _dead_letter_run(
        run, lambda: transitions.fail_expired_run(run.pk, error=error), error=error, error_class="exhausted"
    ):
        logger.warning(
            "consumer %s dead-lettered update %s: %s on its last attempt (%s)",
            run.consumer,
            run.update.update_id,
            error,
            run.attempts,
        )
        return "dead-lettered"
    spec = registry.get(run.consumer)
    delay = spec.delay_after(max(1, run.attempts)) if spec is not None else registry.DEFAULT_BACKOFF[0]
    if transitions.release_expired_run(run.pk, delay=delay, error=error):
        logger.warning(
            "consumer %s on update %s: %s; attempt %s of %s, retried in %.0fs",
            run.consumer,
            run.update.update_id,
            error,
            run.attempts,
            run.max_attempts,
            delay,
        )
        dispatch_run(run.pk, countdown=delay, consumer=run.consumer)
        return "released"
    return ""


def consumer_run_end_stale(run: ConsumerRun, *, spec: registry.ConsumerSpec) -> str:
    """A waiting run older than its consumer's max_age is never run late. The rule:

    - nothing failed yet (no error on record: never run, or only deferred or waiting on an
      open circuit) -> cancelled with the reason ("cancelled");
    - a failure on record (an error, a time-out, a worker lost mid-run, an auth refusal) ->
      failed, with a dead letter of reason `expired` that keeps the last error
      ("dead-lettered"): work that failed must reach an operator, not vanish as cancelled.

    Both are conditional on the state and the error, so a run that failed meanwhile is
    never cancelled. "" when another worker moved the run on first."""
    reason = f"older than the consumer's max age ({spec.max_age}); not run late"
    if transitions.cancel_stale_run(run.pk, reason=reason):
        logger.info("consumer %s on update %s cancelled: %s", spec.name, run.update.update_id, reason)
        return "cancelled"
    error = f"{reason}, after {run.attempts} failed attempt(s)"
    if _dead_letter_run(run, lambda: transitions.fail_stale_run(run.pk), error=error, error_class="expired"):
        logger.warning("consumer %s dead-lettered update %s: %s", spec.name, run.update.update_id, error)
        return "dead-lettered"
    return ""


def new_webhook_secret() -> str:
    """256 random bits in Telegram's alphabet for secret tokens (A-Z a-z 0-9 _ -)."""
    return secrets.token_urlsafe(32)


def bot_webhook_secret_ensure(bot: Bot) -> str:
    """The bot's webhook secret, generated and saved first for a bot made without one."""
    if not bot.webhook_secret:
        bot.webhook_secret = new_webhook_secret()
        Bot.objects.filter(pk=bot.pk, webhook_secret="").update(webhook_secret=bot.webhook_secret)
        bot.refresh_from_db(fields=["webhook_secret"])
        forget_bot()
    return bot.webhook_secret


def add_bot(
    *,
    name: str,
    token: str,
    webhook_secret: str | None = None,
    api_base_url: str | None = None,
    responder: str | None = None,
    rate_limit: int | None = None,
    ops_chat_id: int | None = None,
) -> tuple[Bot, bool]:
    """Create or update a bot (idempotent). Raises ValidationError on bad input."""
    bot = Bot.objects.filter(name=name).first()
    created = bot is None
    if bot is None:
        bot = Bot(name=name, rate_limit=settings.DOVECOTE_DEFAULT_RATE_LIMIT)
    bot.token = token
    if webhook_secret is not None:
        bot.webhook_secret = webhook_secret
    elif not bot.webhook_secret:
        # Every bot has one: the webhook refuses a bot without it (unless DEBUG is on).
        bot.webhook_secret = new_webhook_secret()
    if api_base_url is not None:
        bot.api_base_url = api_base_url
    if responder is not None:
        bot.responder = responder
    if rate_limit is not None:
        bot.rate_limit = rate_limit
    if ops_chat_id is not None:
        bot.ops_chat_id = ops_chat_id
    bot.full_clean(validate_unique=False)
    bot.save()
    return bot, created


class PollingConflict(Exception):
    """getUpdates refused with 409: a webhook is set (or another poller is running)."""


def inbox_poll_fetch(*, bot: Bot, timeout: float = 0, limit: int = 100) -> list[dict[str, Any]]:
    """One long-polling getUpdates request from the bot's stored offset (which confirms
    every update below it to Telegram). Raises PollingConflict on 409."""
    from telegram import error as tg_error

    from outbox import botapi

    params: dict[str, Any] = {"offset": bot.polling_offset, "timeout": int(timeout), "limit": limit}
    allowed = registry.wanted_update_types()
    if allowed:
        params["allowed_updates"] = allowed
    read_timeout = timeout + settings.DOVECOTE_TELEGRAM_READ_TIMEOUT

    async def _get_updates() -> Any:
        client = await botapi.get_bot(bot.token, bot.api_base_url)
        return await client.do_api_request("getUpdates", api_kwargs=params, read_timeout=read_timeout)

    try:
        batch = botapi.run_sync(_get_updates(), timeout=read_timeout + 10)
    except tg_error.Conflict as exc:
        raise PollingConflict(str(exc)) from exc
    return [p for p in batch or [] if isinstance(p, dict) and _int64(p.get("update_id")) is not None]


def inbox_poll_store(*, bot: Bot, batch: list[dict[str, Any]]) -> int:
    """Store a getUpdates batch through the webhook's path (same dedupe) and move the bot's
    offset past it, in one transaction: a crash re-fetches at most this batch, and the
    inbox's unique (bot, update_id) drops it again. Returns how many updates were new."""
    if not batch:
        return 0
    created_count = 0
    with transaction.atomic():
        for payload in batch:
            trace_id = new_trace_id()
            current_trace_id.set(trace_id)
            update, created = inbox_update_store(bot=bot, payload=payload, trace_id=trace_id)
            created_count += created
            logger.info(
                "update %s %s (polling)",
                update.update_id,
                "stored" if created else "duplicate dropped",
                extra={"bot": bot.name, "update_type": update.update_type},
            )
        next_offset = max(p["update_id"] for p in batch) + 1
        Bot.objects.filter(pk=bot.pk, polling_offset__lt=next_offset).update(polling_offset=next_offset)
    current_trace_id.set("")
    bot.polling_offset = max(bot.polling_offset, next_offset)
    return created_count
