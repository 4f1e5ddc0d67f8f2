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
