"""The answers of a batch's requests (outbox/sending/batch.py): those in flight, recorded by
whoever waits for them (the batch's own send, or the late-answers thread, sending/late.py), and
what a drain did (`DrainReport`)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

from core.failpoints import failpoint
from core.logs import current_trace_id
from core.workers import lease_keeper
from outbox import botapi, policy, ratelimit, transitions
from outbox.dispatch import dispatch
from outbox.models import Attempt, ErrorClass, OutboundMessage
from outbox.sending.rules import record_outcome, with_outcome_write_retries

logger = logging.getLogger(__name__)

# Outcomes after which this drain stops and leaves the rest to the retry schedule.
_STOPS_THE_DRAIN = frozenset({ErrorClass.RATE_LIMITED, ErrorClass.AUTH})


@dataclass
class DrainReport:
    """What one drain did, for its task's result and the logs."""

    sent: int = 0
    failed: int = 0
    deferred: int = 0
    cancelled: int = 0
    batches: int = 0
    continuation: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"sent={self.sent} failed={self.failed} deferred={self.deferred} cancelled={self.cancelled}"
        text += f" batches={self.batches}"
        if self.outcomes:
            text += " (" + ", ".join(f"{name}={n}" for name, n in sorted(self.outcomes.items())) + ")"
        if self.continuation is not None:
            text += f" continues-in={self.continuation:.2f}s"
        return text


class InFlight:
    """A batch's requests in flight and what recording their answers needs: whoever waits
    for them (the batch's own send, or the late-answers thread) settles them here."""

    def __init__(
        self,
        bot,
        *,
        worker: str,
        report: DrainReport,
        held: float | None,
        next_in_chat: bool,
        entries: dict[int, ratelimit.Entry] | None,
    ) -> None:
        self.bot, self.worker, self.report, self.held, self.next_in_chat = bot, worker, report, held, next_in_chat
        self.entries = dict(entries or {})
        self.futures: dict[concurrent.futures.Future[botapi.CallOutcome], OutboundMessage] = {}
        self.attempts: dict[int, Attempt] = {}
        self.pending: set[concurrent.futures.Future[botapi.CallOutcome]] = set()
        self.deadline = time.monotonic()
        self.answered = False
        self.circuit_dirty = False  # a success still to be written to the bot's circuit (late answers)
        self.holding: set[int] = set()

    def hold(self, messages: list[OutboundMessage]) -> None:
        """From before their attempts until their answers are recorded these sends are this
        process's, wherever it waits for them (here or the late-answers thread): taking up
        its claims after an outage (reconciliation/resume.py) leaves them alone."""
        ids = [m.pk for m in messages]
        self.holding.update(ids)
        lease_keeper.hold("send", ids)

    def let_go(self, ids: list[int] | set[int]) -> None:
        ids = [pk for pk in ids if pk in self.holding]
        self.holding.difference_update(ids)
        lease_keeper.let_go("send", ids)

    def add(self, started, *, deadline: float) -> None:
        for future, message in started:
            self.futures[future] = message
            self.pending.add(future)
        self.deadline = deadline

    def settle(self, done: set[concurrent.futures.Future[botapi.CallOutcome]]) -> None:
        """Record the answers of `done`; past the deadline with none, every request still out
        is ambiguous (our wait ran out: it may well have reached Telegram)."""
        done = done & self.pending
        if done and not self.answered:
            failpoint("after_response")
            self.answered = True
        if not done and time.monotonic() >= self.deadline:
            outcomes = [(self.futures[f], botapi.outcome_of_lost_wait(TimeoutError())) for f in self.pending]
            self.pending = set()
        else:
            self.pending -= done
            outcomes = [(self.futures[f], f.result()) for f in done]
            # Before the outcomes are recorded: a chat's next message, handed on by its
            # outcome, finds the chat's gate as the answer left it.
            ratelimit.leave([self.entries.pop(m.pk) for m, _ in outcomes if m.pk in self.entries])
        if not outcomes:
            return
        try:
            self.held = with_outcome_write_retries(
                lambda: record(
                    outcomes,
                    self.attempts,
                    worker=self.worker,
                    report=self.report,
                    held=self.held,
                    next_in_chat=self.next_in_chat,
                ),
                message_ids=[m.pk for m, _ in outcomes],
            )
        finally:
            # Recorded, or left `sending` with their attempts for the sweeper (or an outage's take-up).
            self.let_go({m.pk for m, _ in outcomes})


def record(
    outcomes: list[tuple[OutboundMessage, botapi.CallOutcome]],
    attempts: dict[int, Attempt],
    *,
    worker: str,
    report: DrainReport,
    held: float | None,
    next_in_chat: bool = False,
) -> float | None:
    """Record a gathered set of answers. The drain finds a chat's next message with its next
    claim; a send that does not loop (`next_in_chat`) hands it on to the bot's drain."""
    sent = [(m, attempts[m.pk], o) for m, o in outcomes if o.ok]
    done = transitions.mark_sent(sent, worker=worker, next_in_chat=next_in_chat)
    report.sent += len(done)
    for message, _ in outcomes:
        next_id = done.get(message.pk)
        if next_id is not None and next_id != message.pk:
            dispatch(next_id, bot_id=message.bot_id)
    for message, attempt, outcome in sent:
        # Its lease ran out while the request was out, and the sweeper gave it up: the
        # answer still settles it, and nothing is sent again.
        if message.pk not in done and transitions.settle_late_success(message, attempt=attempt, outcome=outcome):
            logger.warning("message %s: success arrived after its lease ran out; settled as sent", message.pk)
            report.sent += 1
    for message, outcome in outcomes:
        if outcome.ok:
            continue
        report.failed += 1
        report.outcomes[outcome.error_class] = report.outcomes.get(outcome.error_class, 0) + 1
        current_trace_id.set(message.trace_id)
        result = record_outcome(message, worker=worker, attempt=attempts[message.pk], outcome=outcome)
        if result.countdown is not None and not message.broadcast:
            # A broadcast's retry is its drain's to send (it looks for the next one due as it stops).
            dispatch(message.pk, countdown=result.countdown, slot_reserved=result.slot_reserved)
        if outcome.error_class in _STOPS_THE_DRAIN:
            wait = result.countdown if result.countdown is not None else policy.MAX_BROKER_COUNTDOWN_SECONDS
            held = max(held or 0.0, time.monotonic() + wait)
    return held
