"""Consumer runs: claiming one, running its consumer, settling what came of it (done,
deferred, paused, retried, dead-lettered); the router's inline runs of a batch; and the
sweeper's ends of runs whose worker was lost or that waited past their consumer's max age."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from bots import registry, transitions
from bots.models import ConsumerRun, RunState
from core import metrics
from core.failpoints import failpoint
from core.logs import current_trace_id
from core.publishing import publish
from core.workers import lease_keeper, worker_id
from outbox.models import Circuit, CircuitState, DeadLetter
from outbox.selectors import MAX_BROKER_COUNTDOWN_SECONDS, consumer_scope
from outbox.services import (
    circuit_open_for_auth,
    circuit_record_success,
    outbound_messages_holding,
    outbound_messages_send_held,
)

logger = logging.getLogger(__name__)


# A run's worker still stuck this long after the soft limit interrupted its consumer (a call
# that ignores the interruption) is ended by Celery's hard limit; its lease then runs out.
HARD_LIMIT_GRACE_SECONDS = 30.0


def dispatch_run(run_pk: int, *, countdown: float = 0.0, consumer: str | None = None) -> bool:
    """Publish the run's task with its consumer's time limits: the soft limit interrupts the
    consumer (a failed attempt, see consumer_run_execute); the hard one, a grace later, ends
    a worker stuck past it, whose run the sweeper then recovers once its lease runs out."""
    from bots.tasks import run_consumer

    if countdown > MAX_BROKER_COUNTDOWN_SECONDS:
        return False  # the sweeper dispatches it when due
    if consumer is None:
        consumer = ConsumerRun.objects.filter(pk=run_pk).values_list("consumer", flat=True).first()
    spec = registry.get(consumer) if consumer else None
    limits: dict[str, float] = {}
    if spec is not None:
        limits = {
            "soft_time_limit": spec.time_limit(),
            "time_limit": spec.time_limit() + HARD_LIMIT_GRACE_SECONDS,
        }
    return publish(run_consumer, (run_pk,), None, countdown=countdown, what=f"consumer run {run_pk}", **limits)


# Set while the router runs inline runs: their successes are told in its one line per update.
quiet_success: ContextVar[bool] = ContextVar("dovecotequiet_success", default=False)


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
                with outbound_messages_holding() as held:
                    outcome = _consumer_run_execute(run_pk, named)
            finally:
                outbound_messages_send_held(held)
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
    scope = consumer_scope(spec.name)
    circuit = Circuit.objects.filter(scope=scope).first()
    if circuit is not None and _still_open(circuit, now):
        # Paused (auth failure or an operator): keep the run; wake it at the probe time.
        if circuit.next_probe_at is not None:
            transitions.postpone_run(run.pk, until=circuit.next_probe_at)
        return "circuit-open"

    worker = worker_id()
    lease = timedelta(seconds=settings.DOVECOTE_CONSUMER_LEASE_SECONDS)
    if spec.runs_async(run.update):
        return _start_awaiting_one(run, spec, worker=worker, lease=lease, circuit_dirty=circuit_dirty(circuit))
    if not transitions.claim_run(run.pk, worker=worker, lease=lease):
        return "claimed-elsewhere"
    outcome, returned = _attempt(run, spec, worker=worker)
    if outcome != "done":
        return outcome
    if circuit_dirty(circuit):
        circuit_record_success(scope)
    transitions.mark_run_done(run.pk, worker=worker, outcome=returned)
    if not quiet_success.get():
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
    scopes = {consumer_scope(spec.name) for pk, spec in specs.items() if spec is not None and pk not in claimed}
    # Usually none: the runs were written claimed (no queryset to build for an empty IN).
    unsettled = {c.scope for c in Circuit.objects.filter(scope__in=scopes) if circuit_dirty(c)} if scopes else set()
    ready: list[ConsumerRun] = []
    for run in runs:
        spec = specs[run.pk]
        if run.pk in claimed:
            ready.append(run)
        elif spec is None or consumer_scope(spec.name) in unsettled:
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
            outcomes[run.pk] = _counted(run.consumer, "claimed-elsewhere")
    try:
        for name, group in groups.items():
            spec = registry.get(name)
            assert spec is not None  # a claimed run's consumer is registered (`_route` matched it)
            with outbound_messages_holding() as held:
                attempted = _attempt_all(group, spec, worker=worker)
            for run, (outcome, returned) in zip(group, attempted, strict=True):
                if outcome == "done":
                    done[run.pk] = returned
                outcomes[run.pk] = outcome
            failpoint("after_inline_runs")  # a consumer's runs run, their replies committed, not sent
            # A consumer's replies go before the next consumer runs (the answer does not wait
            # for the analytics), a batch of sends at a time; what cannot go now is handed to
            # the bot's drain.
            outbound_messages_send_held(held, bots=bots)
            held = []
    finally:
        # What a failure left unsent first (it is committed; the answer should not wait for
        # bookkeeping), then the runs marked done: a crash between them re-runs the runs,
        # whose replies' keys are taken, so nothing is sent twice.
        outbound_messages_send_held(held, bots=bots)
        transitions.mark_runs_done(done, worker=worker)
    for run in ready:
        if run.pk in claimed:
            _counted(run.consumer, outcomes[run.pk])
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


def circuit_dirty(circuit: Circuit | None) -> bool:
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

            # async_func is spec.func: a coroutine function, whose call is a coroutine.
            returned: Any = aio.wait_for(spec.func(ctx))  # type: ignore[arg-type]
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
        delay = circuit_open_for_auth(consumer_scope(spec.name), reason=str(exc))
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
