"""Late answers: the Bot API answers that a worker's inline send did not wait for.

A worker sending what it has just written waits for Telegram only briefly
(batch.INLINE_ANSWER_WAIT_SECONDS); requests still out are handed here and one thread records
each outcome as the batch would have (answers.InFlight.settle), while the router goes on. If the
process dies first, each message is `sending` with its attempt row, so the sweeper treats it
as any send cut off mid-request. A worker shutting down waits for its late answers (`drain`)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from celery.signals import worker_process_shutdown, worker_shutdown

if TYPE_CHECKING:
    from outbox.sending.answers import InFlight

logger = logging.getLogger(__name__)

# The thread looks for newly handed batches at least this often while it waits.
_POLL_SECONDS = 0.2
# Answers arriving within this long of the first are recorded by one statement each batch.
_GATHER_SECONDS = 0.05


class LateAnswers:
    def __init__(self) -> None:
        self._batches: list[InFlight] = []
        self._changed = threading.Condition()
        self._pid = 0

    def take(self, batch: InFlight) -> None:
        """Record this batch's answers as they come, from this process's thread."""
        with self._changed:
            if self._pid != os.getpid():  # the parent's thread is not in a forked child
                self._pid = os.getpid()
                self._batches = []
                threading.Thread(target=self._run, name="dovecote-late-answers", daemon=True).start()
            self._batches.append(batch)
            self._changed.notify_all()

    def waiting_for(self, bot_id: int) -> bool:
        """Whether answers of this bot are still out (the Bot API is slow for it now)."""
        with self._changed:
            return any(batch.bot.pk == bot_id for batch in self._batches)

    def drain(self, timeout: float) -> bool:
        """Wait until every late answer is recorded (a worker shutting down); False if some
        were still out after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._batches and self._pid == os.getpid():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._batches:
                    self._changed.wait()
                batches = list(self._batches)
            pending = set().union(*(batch.pending for batch in batches))
            until = min(batch.deadline for batch in batches)
            timeout = max(0.0, min(until - time.monotonic(), _POLL_SECONDS))
            done, rest = concurrent.futures.wait(
                pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )
            if done and rest:
                more, _ = concurrent.futures.wait(rest, timeout=_GATHER_SECONDS)
                done |= more
            finished = [batch for batch in batches if self._settle(batch, done)]
            if finished:
                with self._changed:
                    self._batches = [batch for batch in self._batches if batch not in finished]
                    idle = not self._batches
                    self._changed.notify_all()
                if idle:
                    # Late answers are the exception: no connection is held between them.
                    from django.db import connection

                    connection.close()

    @staticmethod
    def _settle(batch: InFlight, done: set) -> bool:
        """Record what came for this batch; True once nothing of it is out any more."""
        from django.db import close_old_connections

        from outbox import circuits

        try:
            if done & batch.pending or time.monotonic() >= batch.deadline:
                sent_before = batch.report.sent
                batch.settle(done)
                if batch.circuit_dirty and batch.report.sent > sent_before:
                    circuits.record_success(circuits.bot_scope(batch.bot.pk))
                    batch.circuit_dirty = False
        except Exception:
            # Its messages stay `sending` with their attempts: the sweeper settles them as
            # any send cut off mid-request.
            logger.exception("recording late answers of messages %s failed", [m.pk for m in batch.futures.values()])
            batch.let_go(set(batch.holding))
            close_old_connections()
            return True
        return not batch.pending


late_answers = LateAnswers()


def _drain_on_shutdown(**kwargs: object) -> None:
    from outbox import botapi

    if not late_answers.drain(timeout=botapi.send_timeout() + 5):
        logger.warning("shutting down with late answers still out: the sweeper settles their messages")


worker_process_shutdown.connect(_drain_on_shutdown, dispatch_uid="outbox.late_answers.process_shutdown", weak=False)
worker_shutdown.connect(_drain_on_shutdown, dispatch_uid="outbox.late_answers.shutdown", weak=False)
