"""Awaiting consumer runs: many per worker process, on one event loop.

A consumer that waits on the network (a model, a CRM) would hold a Celery process for the
whole wait. Its awaiting form (an `async def`, bots/registry.py) runs instead on the process's
one event loop - the loop the Bot API client already runs in a daemon thread
(outbox/botapi.py), so python-telegram-bot handlers can run on it too (`loop()`, `submit()`) -
up to DOVECOTE_ASYNC_CONCURRENCY runs at once, with the rules of a run in a Celery task
(bots/runs.py). Database work goes through `db()`, in one of DOVECOTE_ASYNC_DB_CONNECTIONS
threads; no transaction is held across an `await`. How a run goes: docs/AWAITING.md."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection

from core import metrics
from core.logs import current_trace_id
from core.workers import lease_keeper, worker_id
from outbox import botapi

if TYPE_CHECKING:
    from bots.models import ConsumerRun
    from bots.registry import ConsumerContext, ConsumerSpec
    from outbox.models import OutboundMessage

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A settling step that failed on the database (PostgreSQL restarting) is tried again after
# each of these pauses; then the run is let go, and the sweeper takes it over at its lease's end.
SETTLE_RETRY_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0)


class _Process:
    """This process's slots, database threads, HTTP client and chat turns (after a fork, a
    new one: a Celery prefork child does not share its parent's)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.slots = threading.Semaphore(settings.DOVECOTE_ASYNC_CONCURRENCY)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.DOVECOTE_ASYNC_DB_CONNECTIONS, thread_name_prefix=DB_THREAD_PREFIX
        )
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.idle = threading.Event()
        self.idle.set()
        self.http: httpx.AsyncClient | None = None
        # (consumer, bot, chat) -> the future the chat's latest started run resolves as it ends.
        self.turns: dict[tuple[str, int, int], asyncio.Future[None]] = {}
        self.gathered: dict[Callable[[list[Any]], list[Any]], _Gathered] = {}


_process: _Process | None = None
_process_lock = threading.Lock()


def _proc() -> _Process:
    global _process
    with _process_lock:
        if _process is None or _process.pid != os.getpid():
            _process = _Process()
        return _process


def loop() -> asyncio.AbstractEventLoop:
    """This process's event loop (the seam for python-telegram-bot's handlers)."""
    return botapi.process_loop()


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start a coroutine on this process's loop, from any other thread."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def wait_for(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on this process's loop and wait for it (a Celery task's awaiting
    consumer when the loop takes no runs): cancelled there if the wait is interrupted."""
    future = submit(coro)
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


def in_flight() -> int:
    return _proc().in_flight


def peak_in_flight() -> int:
    return _proc().peak


def wait_idle(timeout: float) -> bool:
    """Wait until no run is in flight in this process (a worker shutting down)."""
    return _proc().idle.wait(timeout)


# --- the database threads ---------------------------------------------------------------


async def db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` run whole in one of this process's database threads, in a copy
    of the caller's context (its trace id)."""
    context = contextvars.copy_context()
    step = functools.partial(context.run, _db_step, fn, args, kwargs)
    return await asyncio.get_running_loop().run_in_executor(_proc().pool, step)


DB_THREAD_PREFIX = "dovecote-db"


def name_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    """A database thread's PostgreSQL connection says whose it is (pg_stat_activity's
    application_name): an operator, and bench/ai_crowd.py, count them per worker process."""
    if threading.current_thread().name.startswith(DB_THREAD_PREFIX):
        from bots import sql

        with connection.cursor() as cursor:
            cursor.execute(sql.SET_APPLICATION_NAME, [f"dovecote-aio:{os.getpid()}"])


def _db_step(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    # What Django does around a request, here around each step: a connection broken by a
    # restart of PostgreSQL is dropped, and the next step opens a new one.
    close_old_connections()
    try:
        return fn(*args, **kwargs)
    finally:
        if connection.in_atomic_block:  # a step must end its transactions; never carry one on
            logger.error("a database step returned inside a transaction: rolled back and closed")
            connection.close()
        close_old_connections()


class _Gathered:
    """Items of one kind of write that runs hand in while a database thread is busy with the
    previous lot, written together in one step (`write_many(items)`, one result or exception
    per item): a hundred answers arriving together cost a few statements, not a hundred of
    each. One lot at a time per kind and process; the loop's thread only ever touches it."""

    def __init__(self, write_many: Callable[[list[Any]], list[Any]]) -> None:
        self.write_many = write_many
        self.waiting: list[tuple[Any, asyncio.Future[Any]]] = []
        self.writing = False

    async def put(self, item: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.append((item, future))
        if not self.writing:
            self.writing = True
            asyncio.get_running_loop().create_task(self._write())
        return await future

    async def _write(self) -> None:
        try:
            while self.waiting:
                lot, self.waiting = self.waiting, []
                try:
                    results = await db(self.write_many, [item for item, _ in lot])
                except Exception as exc:  # noqa: BLE001 - the database: each run settles it
                    results = [exc] * len(lot)
                for (_, future), result in zip(lot, results, strict=True):
                    if future.done():  # its run's time limit ran out meanwhile
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self.writing = False


async def gathered(write_many: Callable[[list[Any]], list[Any]], item: Any) -> Any:
    """`write_many([item])`'s result for this item, written with the other runs' items of
    the same kind that are waiting (`_Gathered`)."""
    proc = _proc()
    lot = proc.gathered.get(write_many)
    if lot is None:
        lot = proc.gathered[write_many] = _Gathered(write_many)
    return await lot.put(item)


async def reply(ctx: ConsumerContext, text: str, **payload: Any) -> OutboundMessage:
    """`ctx.reply` from the event loop, written with the other runs' replies waiting then
    (one INSERT for the lot on PostgreSQL)."""
    call = ctx._enqueue_call(method="sendMessage", key=None, options={}, **ctx._reply_call(text, payload))
    return await gathered(_write_replies, call)


def _write_replies(calls: list[dict[str, Any]]) -> list[Any]:
    from bots.registry import enqueue_many

    return enqueue_many(calls)


def http_client() -> httpx.AsyncClient:
    """This process's HTTP client for awaiting consumers (the openai responder, crm_webhook):
    one `httpx.AsyncClient` on the loop, its connections in pools of `POOL_SIZE` (`_Pools`)."""
    proc = _proc()
    if proc.http is None:
        # The worker in the User-Agent: the other side's logs (and the bench's fake model) can
        # tell how many calls each worker process has in flight.
        proc.http = httpx.AsyncClient(
            transport=_Pools(settings.DOVECOTE_ASYNC_CONCURRENCY),
            headers={"User-Agent": f"dovecote ({worker_id()})"},
        )
    return proc.http


# Connections per pool of the HTTP client. httpcore's pool looks through all its requests and
# connections each time one is placed or ends, so its cost per request grows with its size:
# with 256 connections in one pool that search was most of the loop's time (bench/ai_crowd.py
# under py-spy); in pools of this size it is a small part.
POOL_SIZE = 32


class _Pools(httpx.AsyncBaseTransport):
    """Requests spread in turn over several connection pools, together as large as the
    process's runs may need."""

    def __init__(self, connections: int) -> None:
        n = max(1, -(-connections // POOL_SIZE))
        limits = httpx.Limits(max_connections=POOL_SIZE, max_keepalive_connections=POOL_SIZE)
        self.pools = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(n)]
        self.turn = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.turn = (self.turn + 1) % len(self.pools)
        return await self.pools[self.turn].handle_async_request(request)

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


# --- slots --------------------------------------------------------------------------------


def take_slots(n: int, *, timeout: float) -> int:
    """Up to `n` slots for runs about to start: waits up to `timeout` for the first, takes
    the rest that are free now. Returns how many were taken (0: none came free in time)."""
    slots = _proc().slots
    if n <= 0 or not slots.acquire(timeout=timeout):
        return 0
    taken = 1
    while taken < n and slots.acquire(blocking=False):
        taken += 1
    return taken


def release_slots(n: int) -> None:
    for _ in range(n):
        _proc().slots.release()


# --- runs -----------------------------------------------------------------------------------


def start(run: ConsumerRun, spec: ConsumerSpec, *, worker: str, circuit_dirty: bool = False) -> None:
    """Start a run this process has claimed (its attempts counting this one) and holds a slot
    for, with its update and bot loaded. Returns at once; the run settles itself."""
    proc = _proc()
    lease_keeper.hold("run", [run.pk])
    with proc.lock:
        proc.in_flight += 1
        proc.peak = max(proc.peak, proc.in_flight)
        proc.idle.clear()
    try:
        submit(_run(run, spec, worker=worker, circuit_dirty=circuit_dirty))
    except BaseException:
        _ended(run)
        raise


def _ended(run: ConsumerRun) -> None:
    proc = _proc()
    lease_keeper.let_go("run", [run.pk])
    with proc.lock:
        proc.in_flight -= 1
        if proc.in_flight == 0:
            proc.idle.set()
    proc.slots.release()


async def _run(run: ConsumerRun, spec: ConsumerSpec, *, worker: str, circuit_dirty: bool) -> None:
    from bots.registry import ConsumerContext, TimedOut

    proc = _proc()
    current_trace_id.set(run.trace_id)
    chat = run.update.chat_id
    key = (spec.name, run.bot_id, chat) if chat is not None else None
    mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    earlier = proc.turns.get(key) if key else None
    if key:
        proc.turns[key] = mine
    ctx = ConsumerContext(update=run.update, consumer=spec.name, trace_id=run.trace_id, attempt=run.attempts)
    if earlier is not None:
        ctx._turn = asyncio.shield(earlier)  # a run timed out waiting must not cancel the earlier one's
    outcome = "lost"
    try:
        assert spec.async_func is not None
        error: BaseException | None = None
        returned: Any = None
        try:
            async with asyncio.timeout(spec.time_limit()) as limit:
                returned = await spec.async_func(ctx)
        except TimeoutError as exc:
            error = TimedOut(str(exc)) if limit.expired() else exc
        except Exception as exc:  # noqa: BLE001 - a consumer's failure is settled for its run alone
            error = exc
        if error is None and not circuit_dirty:
            outcome = await _settle(gathered, _mark_done, (run, returned, worker))
        elif error is None:
            outcome = await _settle(db, _finish, run, spec, returned, worker, circuit_dirty)
        else:
            outcome = await _settle(db, _fail, run, spec, error, worker)
    except Exception:
        logger.exception("consumer %s on update %s: the run could not be settled", spec.name, run.update.update_id)
    finally:
        mine.set_result(None)
        if key and proc.turns.get(key) is mine:
            del proc.turns[key]
        _ended(run)
    metrics.CONSUMER_RUNS.labels(consumer=spec.name, outcome=outcome).inc()


async def _settle(how: Callable[..., Any], *args: Any) -> str:
    """A settling step (`db(fn, ...)` or `gathered(fn, item)`), tried again while the database
    is away; "lost" when it never got through (the run is let go: the sweeper takes it over)."""
    for pause in (*SETTLE_RETRY_SECONDS, None):
        try:
            return await how(*args)
        except DatabaseError as exc:
            if pause is None:
                logger.warning("a run's settling failed on the database (%s); left to the sweeper", exc)
                return "lost"
            await asyncio.sleep(pause)
    return "lost"


def _finish(run: ConsumerRun, spec: ConsumerSpec, returned: Any, worker: str, circuit_dirty: bool) -> str:
    from bots import transitions
    from bots.runs import quiet_success
    from outbox.selectors import consumer_scope
    from outbox.services import circuit_record_success

    if circuit_dirty:
        circuit_record_success(consumer_scope(spec.name))
    outcome = returned if isinstance(returned, str) else "done"
    transitions.mark_run_done(run.pk, worker=worker, outcome=outcome)
    if not quiet_success.get():
        logger.info("consumer %s done on update %s: %s", spec.name, run.update.update_id, outcome)
    return "done"


def _mark_done(items: list[tuple[ConsumerRun, Any, str]]) -> list[str]:
    """Runs done, marked in one statement (their circuits plainly closed)."""
    from bots import transitions
    from bots.runs import quiet_success

    outcomes = {run.pk: returned if isinstance(returned, str) else "done" for run, returned, _ in items}
    for worker in {worker for _, _, worker in items}:
        transitions.mark_runs_done(
            {run.pk: outcomes[run.pk] for run, _, owner in items if owner == worker}, worker=worker
        )
    if not quiet_success.get():
        for run, _, _ in items:
            logger.info("consumer %s done on update %s: %s", run.consumer, run.update.update_id, outcomes[run.pk])
    return ["done"] * len(items)


def _fail(run: ConsumerRun, spec: ConsumerSpec, error: BaseException, worker: str) -> str:
    from bots.runs import consumer_run_settle_failure

    return consumer_run_settle_failure(run, spec, error, worker=worker)


def start_routed(runs: list[ConsumerRun], *, timeout: float) -> list[ConsumerRun]:
    """The router's awaiting runs, just written and committed (pending), started here: a slot
    each (waiting up to `timeout` for room), claimed in one statement per chunk. A run whose
    consumer's circuit is not plainly closed is left for a task of its own, which checks it.
    Returns the runs not started here, for the caller to dispatch."""
    from bots import transitions
    from bots.runs import circuit_dirty
    from core.workers import claim_lease
    from outbox.models import Circuit
    from outbox.selectors import consumer_scope

    if not runs:
        return []
    scopes = {consumer_scope(run.consumer) for run in runs}
    dirty = {c.scope for c in Circuit.objects.filter(scope__in=scopes) if circuit_dirty(c)}
    left = [run for run in runs if consumer_scope(run.consumer) in dirty]
    waiting = [run for run in runs if consumer_scope(run.consumer) not in dirty]
    worker = worker_id()
    deadline = time.monotonic() + timeout
    while waiting:
        n = take_slots(len(waiting), timeout=max(0.0, deadline - time.monotonic()))
        if n == 0:
            break
        chunk, waiting = waiting[:n], waiting[n:]
        claimed = transitions.claim_runs([run.pk for run in chunk], worker=worker, lease=claim_lease())
        release_slots(n - len(claimed))
        for run in chunk:
            if run.pk in claimed:
                run.attempts = claimed[run.pk]
                from bots import registry

                spec = registry.get(run.consumer)
                assert spec is not None  # claimed runs are of registered consumers
                start(run, spec, worker=worker)
    return left + waiting
