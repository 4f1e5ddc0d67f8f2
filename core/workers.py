"""Who holds a claim: this process's worker id, written to a row's `lease_owner` by every
claim (outbound messages, consumer runs, effects), and the lease keeper that renews the
claims a live process holds.

A consumer run (and an effect inside it) may take minutes, yet a worker that dies must not
keep its claims for minutes. So their lease is short (DOVECOTE_CONSUMER_LEASE_SECONDS) and a
thread of the process that holds them renews it every third of its length: a live worker
keeps its claims for as long as it works, a dead one loses them within one lease. A worker
stuck for good is ended by Celery's hard time limit, which stops the renewals too.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from django.conf import settings

logger = logging.getLogger(__name__)


def worker_id() -> str:
    """host:pid of this process."""
    # Recomputed after fork: prefork children must not share their parent's id.
    return f"{socket.gethostname()}:{os.getpid()}"


# renew(keys, worker=..., lease=...) for one kind of claim: extends the lease of those of the
# keys still held by `worker`, and only theirs.
Renew = Callable[..., Any]


def claim_lease() -> timedelta:
    """How long a consumer run's (or an effect's) claim lasts without a renewal."""
    return timedelta(seconds=settings.DOVECOTE_CONSUMER_LEASE_SECONDS)


class LeaseKeeper:
    """The claims this process holds, by kind, and the thread that renews them."""

    def __init__(self) -> None:
        self._renewers: dict[str, Renew] = {}
        self._held: dict[str, Counter[Any]] = {}
        self._lock = threading.Lock()
        self._pid = 0
        self._wake = threading.Event()

    def register(self, kind: str, renew: Renew) -> None:
        self._renewers[kind] = renew

    @contextmanager
    def holding(self, kind: str, keys: Iterable[Any]) -> Iterator[None]:
        """While the block runs, this process's claims on `keys` are renewed."""
        keys = list(keys)
        self.hold(kind, keys)
        try:
            yield
        finally:
            self.let_go(kind, keys)

    def hold(self, kind: str, keys: Iterable[Any]) -> None:
        """Renew this process's claims on `keys` until `let_go` (a run on the event loop,
        bots/aio.py, whose life is not one block of its starter's)."""
        with self._lock:
            self._ensure_thread()
            self._held.setdefault(kind, Counter()).update(keys)

    def let_go(self, kind: str, keys: Iterable[Any]) -> None:
        with self._lock:
            held = self._held.get(kind)
            if held is not None:
                for key in keys:
                    held[key] -= 1
                    if held[key] <= 0:
                        del held[key]

    def held(self, kind: str) -> list[Any]:
        with self._lock:
            return list(self._held.get(kind, ()))

    def renew_now(self) -> None:
        """Renew every held claim once (the thread's tick)."""
        from django.db import connection

        worker, lease = worker_id(), claim_lease()
        try:
            for kind, renew in self._renewers.items():
                keys = self.held(kind)
                if not keys:
                    continue
                try:
                    renew(keys, worker=worker, lease=lease)
                except Exception as exc:  # noqa: BLE001 - the database may be away; the next tick tries again
                    logger.warning("could not renew the leases of %d %s claim(s): %s", len(keys), kind, exc)
        finally:
            # A tick every few seconds need not hold a connection of its own in between.
            connection.close()

    def _ensure_thread(self) -> None:
        # After a fork the parent's thread is not in the child, nor are its claims.
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._held = {}
        threading.Thread(target=self._run, name="dovecote-leases", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._wake.wait(max(0.5, settings.DOVECOTE_CONSUMER_LEASE_SECONDS / 3))
            self._wake.clear()
            self.renew_now()


lease_keeper = LeaseKeeper()


class OutageWatch:
    """This process's watch for PostgreSQL or Redis going away and coming back.

    Whatever meets one of them failing says so (`note`). From then a thread looks every
    POLL_SECONDS; once both answer it calls the registered resumers (reconciliation/resume.py)
    with the moment the outage was first noted; a resumer that fails is tried again at the
    next look. `start(watch_redis=True)` (a worker) also notes an outage when its key in Redis
    is gone: Redis restarted empty. Why: docs/DESIGN.md, `reconciliation/resume.py`."""

    POLL_SECONDS = 0.5
    EPOCH_CHECK_SECONDS = 1.0

    def __init__(self) -> None:
        self._resumers: list[Callable[[float], object]] = []
        self._lock = threading.Lock()
        self._since: float | None = None
        self._pid = 0
        self._watch_redis = False
        self._enabled = False  # started in a worker or web process; never in a test's own
        self._wake = threading.Event()

    def register(self, resume: Callable[[float], object]) -> None:
        self._resumers.append(resume)

    def start(self, *, watch_redis: bool = False) -> None:
        with self._lock:
            self._enabled = True
            self._watch_redis = self._watch_redis or watch_redis
            self._pid = 0  # a forked child starts its own thread
            self._ensure_thread()

    def note(self, what: str = "") -> None:
        """PostgreSQL or Redis failed here: resume when both answer again (in a process
        that started the watch)."""
        if not self._enabled:
            return
        with self._lock:
            if self._since is None:
                self._since = time.time()
                logger.warning("%s: resuming once PostgreSQL and Redis answer", what)
            self._ensure_thread()
        self._wake.set()

    def pending(self) -> float | None:
        """When the outage still to resume from was first noted, or None."""
        return self._since

    def _ensure_thread(self) -> None:
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        threading.Thread(target=self._run, name="dovecote-outage-watch", daemon=True).start()

    def _run(self) -> None:
        last_epoch = 0.0
        while True:
            self._wake.wait(self.POLL_SECONDS if self._since is not None else self.EPOCH_CHECK_SECONDS)
            self._wake.clear()
            if self._watch_redis and time.monotonic() - last_epoch >= self.EPOCH_CHECK_SECONDS:
                last_epoch = time.monotonic()
                self._check_epoch()
            if self._since is not None:
                self.resume_if_back()

    def _check_epoch(self) -> None:
        import redis

        from core import connections

        try:
            if connections.shared_redis().set(epoch_key(), b"1", nx=True):
                self.note("Redis lost its keys")
        except redis.RedisError:
            self.note("Redis unreachable")

    def resume_if_back(self) -> bool:
        """When both answer: run the resumers for the outage noted (True), else False."""
        since = self._since
        if since is None or not _both_answer():
            return False
        with self._lock:
            self._since = None
        from core import publishing

        publishing.reset()  # publish at once, not after the broker-down backoff
        try:
            for resume in self._resumers:
                resume(since)
        except Exception:
            logger.exception("resuming after the outage failed; trying again")
            with self._lock:
                self._since = since if self._since is None else min(since, self._since)
            return False
        finally:
            from django.db import connection

            connection.close()
        return True


def epoch_key() -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:epoch"


def _both_answer() -> bool:
    import redis

    from core import connections

    try:
        connections.shared_redis().set(epoch_key(), b"1")
    except redis.RedisError:
        return False
    return connections.check_database()[0]


outage_watch = OutageWatch()
