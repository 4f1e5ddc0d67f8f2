"""Coalesced wake-ups: one Redis key per (kind, bot) says a task of that kind is queued or
running for the bot, so a burst of work publishes one task instead of one per item.

Whoever sets the key (SET NX) publishes the task. The running task renews it; when it runs out
of work it deletes the key and looks once more, so nothing committed meanwhile is left without
a task. A lost task's key expires (KEY_TTL_MS). When Redis fails, `take` says None and the work
waits in its rows for the sweeper. A task may linger with its key (`await_nudge`) and be nudged
instead of a publish. The protocol in full: docs/DESIGN.md."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import cache

import redis
from django.conf import settings

from core import connections

logger = logging.getLogger(__name__)

# How long a key outlives a task that died, or a task lost with its broker message (a
# running task renews it each round; a round slower than this only lets a second one start).
KEY_TTL_MS = 5_000
# A running task renews its key once this long has passed since it last did (or since the
# wake-up set it): a round trip a second, not one per round. A key that expires anyway (its
# task waited long in the queue) only lets a second task start, which the protocol allows.
RENEW_AFTER_SECONDS = 1.0


def key(kind: str, bot_id: int) -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:{kind}:{bot_id}"


# A lingering task waits for a nudge this long at a time, then sees whether other tasks wait
# in the broker's queues for a worker (it hands its worker back to them).
LINGER_SLICE_SECONDS = 0.05


def nudges_key(name: str) -> str:
    return f"{name}:nudges"


def take(name: str, *, countdown: float = 0.0, nudge: bool = False) -> bool | None:
    """SET NX, for a task due in `countdown` seconds: True when set (publish the task), False
    when already there (a task is coming), None when Redis failed. `nudge`: in the same round
    trip, push a nudge for a task lingering with the key (a task just published ignores it)."""
    try:
        if not nudge:
            return bool(connections.shared_redis().set(name, b"1", nx=True, px=int(countdown * 1000) + KEY_TTL_MS))
        pipe = connections.shared_redis().pipeline(transaction=False)
        pipe.set(name, b"1", nx=True, px=int(countdown * 1000) + KEY_TTL_MS)
        pipe.rpush(nudges_key(name), b"1")
        pipe.pexpire(nudges_key(name), KEY_TTL_MS)
        return bool(pipe.execute()[0])
    except redis.RedisError as exc:
        logger.warning("could not set %s: %s", name, exc)
        _note_outage("a wake-up failed")
        return None


def wake(name: str, publish: Callable[[], bool], *, countdown: float = 0.0, nudge: bool = False) -> bool | None:
    """Publish the task (after `countdown`) unless one is queued or running. True: a task
    is coming; False: the publish failed (the key is let go, so the next wake-up tries
    again); None: Redis failed, nothing was published, the caller decides the fallback.
    `nudge`: a task lingering with the key (await_nudge) looks again."""
    taken = take(name, countdown=countdown, nudge=nudge)
    if taken is None:
        return None
    if not taken:
        return True  # the queued or running task will see the work
    if publish():
        return True
    release(name)
    return False


def hand_over(name: str, publish: Callable[[], bool], *, holds_key: bool, countdown: float = 0.0) -> None:
    """A task's continuation: it inherits the key (kept alive until it runs), or, from a
    task that no longer holds it, it is an ordinary wake-up."""
    if not holds_key:
        wake(name, publish, countdown=countdown)
        return
    renew(name, countdown=countdown)
    if not publish():
        release(name)  # the next wake-up, or the sweeper


def renew(name: str, *, countdown: float = 0.0) -> None:
    """Keep the key for a task that runs on (or runs again in `countdown` seconds)."""
    _quietly("pexpire", name, int(countdown * 1000) + KEY_TTL_MS)


def release(name: str) -> None:
    _quietly("delete", name)


def await_nudge(name: str, seconds: float, busy_queues: Sequence[str]) -> bool:
    """The task holding the key waits up to `seconds` for a nudge, renewing the key as it
    waits. True: nudged (it looks again, still holding the key). False: the time passed,
    other tasks wait in `busy_queues` (the broker's lists, in this Redis) for a worker, or
    Redis failed; the task then lets go and looks once more, as without lingering."""
    client = connections.shared_redis()
    nudges = nudges_key(name)
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            pipe = client.pipeline(transaction=False)
            pipe.pexpire(name, KEY_TTL_MS)
            for queue in busy_queues:
                pipe.llen(queue)
            pipe.blpop([nudges], timeout=min(left, LINGER_SLICE_SECONDS))
            # Runs as the BLPOP returns, in the same round trip: one look answers every
            # nudge pushed before it. A nudge it deleted (pushed after a timed-out BLPOP)
            # counts as one.
            pipe.delete(nudges)
            _, *waiting, nudged, deleted = pipe.execute()
            if any(waiting):
                return False  # a nudge taken here is seen by the look once more
            if nudged is not None or deleted:
                return True
    except redis.RedisError as exc:
        logger.warning("stopped waiting on %s: %s", nudges, exc)
    return False


# A nudge for the task holding the key, only while one holds it: a stray nudge would make the
# next task's first wait end at once for an empty look.
_NUDGE_IF_HELD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""


@cache
def _nudge_if_held_script():
    return connections.shared_redis().register_script(_NUDGE_IF_HELD_LUA)


def nudge_if_held(name: str) -> bool | None:
    """One round trip, and never a publish: when a task holds the key (queued, running or
    lingering), nudge it and say True; the work is then seen as after a SET NX that found
    the key (the nudge, the task's next look, or its look once more after letting go).
    False: no task holds it (a wake-up must publish one). None: Redis failed."""
    try:
        client = connections.shared_redis()
        return bool(_nudge_if_held_script()(keys=[name, nudges_key(name)], args=[KEY_TTL_MS], client=client))
    except redis.RedisError as exc:
        logger.warning("could not nudge %s: %s", name, exc)
        _note_outage("a wake-up failed")
        return None


# Permits: at most `limit` holders of a name at once (a host's broadcast drains), each for
# KEY_TTL_MS unless it takes its permit again; a holder that died lets go when it expires.
_PERMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


@cache
def _permit_script():
    return connections.shared_redis().register_script(_PERMIT_LUA)


def take_permit(name: str, holder: str, *, limit: int) -> bool:
    """One of `limit` permits of `name` for `holder` (again: renewed), or False when all are
    held. Redis failing: True - the permits only share the workers out, and the work it
    guards cannot go on without Redis anyway."""
    try:
        return bool(_permit_script()(keys=[name], args=[holder, limit, KEY_TTL_MS], client=connections.shared_redis()))
    except redis.RedisError as exc:
        logger.warning("could not take a permit of %s: %s", name, exc)
        return True


def return_permit(name: str, holder: str) -> None:
    _quietly("zrem", name, holder)


def _note_outage(what: str) -> None:
    # What the failed wake-up left is handed on as soon as Redis is back (core/workers.py).
    from core.workers import outage_watch

    outage_watch.note(what)


def _quietly(command: str, *args: object) -> None:
    with contextlib.suppress(redis.RedisError):  # the key expires by itself
        getattr(connections.shared_redis(), command)(*args)


class Deferred:
    """Wake-ups handed to a thread of this process, so a request does not wait on Redis or
    the broker, and a burst costs one round trip per round instead of one per item.

    `add(key, item)` returns at once; the thread calls `wake_up(key, items)` with every item added
    since its previous round, each round after the items were committed, pausing `interval` between
    rounds. `at_once(key, item)`, when given, is tried in the caller's thread while the process is
    quiet: True when the item needs nothing more, False to hand it to the thread, None when Redis
    failed (then the thread takes the items for AT_ONCE_BACKOFF_SECONDS). A process that dies with
    items here is like Redis failing. More: docs/DESIGN.md."""

    AT_ONCE_BACKOFF_SECONDS = 5.0

    def __init__(
        self,
        wake_up: Callable[[int, list[int]], object],
        *,
        interval: float = 0.01,
        at_once: Callable[[int, int], bool | None] | None = None,
    ) -> None:
        self._wake_up = wake_up
        self._interval = interval
        self._at_once = at_once
        self._last_add = 0.0
        self._at_once_after = 0.0
        self._lock = threading.Lock()
        self._items: dict[int, list[int]] = {}
        self._ready = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._waiting = False  # the thread waits for items (not in a round, not pausing)

    def add(self, key: int, item: int) -> None:
        now = time.monotonic()
        quiet = self._waiting and not self._items and now - self._last_add >= self._interval
        self._last_add = now
        if quiet and self._at_once is not None and now >= self._at_once_after and self._try_at_once(key, item):
            return
        with self._lock:
            self._items.setdefault(key, []).append(item)
            self._idle.clear()
            # Started lazily, and again in a forked child (gunicorn forks its workers).
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="dovecote-wake-ups", daemon=True)
                self._thread.start()
        self._ready.set()
        if self._waiting:
            # Hand the thread the GIL now: it would otherwise wait for it until this request
            # next blocks (writing its response); its round trip lets the GIL go at once.
            time.sleep(0)

    def _try_at_once(self, key: int, item: int) -> bool:
        try:
            done = self._at_once(key, item)  # type: ignore[misc] - checked by the caller
        except Exception:  # the thread has it then
            logger.exception("wake-up for %s in the request failed", key)
            done = None
        if done is None:
            self._at_once_after = time.monotonic() + self.AT_ONCE_BACKOFF_SECONDS
        return bool(done)

    def flush(self, timeout: float = 2.0) -> bool:
        """Wait until every item added so far is handed over (a worker about to exit)."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            self._waiting = True
            self._ready.wait()
            self._waiting = False
            self._ready.clear()
            with self._lock:
                items, self._items = self._items, {}
            for key, keyed in items.items():
                try:
                    self._wake_up(key, keyed)
                except Exception:  # the thread must outlive any one failure; the sweeper has the rows
                    logger.exception("wake-up for %s failed", key)
            with self._lock:
                if not self._items:
                    self._idle.set()
            time.sleep(self._interval)
