"""The batched drain: one task sends a bot's due messages in batches.

One statement claims up to DOVECOTE_DRAIN_BATCH_SIZE due messages (SKIP LOCKED), one writes
their attempt rows, the requests go out together on the process's event loop, and the
successes are recorded in one statement. Every rule of the single send holds, through the same
transitions (outbox/sending/rules.py): two commits before any request, one ordered message per
chat at a time, expiry, the relevance check, a rate-limit slot per message. Waking a drain is
coalesced per bot (outbox/dispatch.py). Broadcasts have a drain of their own,
`outbound_broadcasts_drain`, on the bulk queue. Why: docs/DESIGN.md."""

from __future__ import annotations

import concurrent.futures
import logging
import math
import socket
import time
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from core import rows, wakeups
from core.failpoints import failpoint, uncommitted
from core.logs import current_trace_id
from core.workers import worker_id
from outbox import botapi, circuits, policy, ratelimit, selectors, transitions
from outbox.dispatch import (
    bulk_drain_key,
    continue_bulk_drain,
    continue_drain,
    dispatch,
    drain_key,
    extra_drain_key,
    fan_out_drain,
    wake_bulk_drain,
)
from outbox.models import CircuitState, OutboundMessage
from outbox.sending.answers import DrainReport, InFlight
from outbox.sending.late import late_answers
from outbox.sending.rules import cancel_reason, limited_chat_id

logger = logging.getLogger(__name__)

# A drain hands the worker back after this long, publishing its continuation, so that other
# bots' drains and the inbox's tasks get their turn on a busy worker; sooner when it is only
# pacing a bot at its rate limit, which holds the worker without using it.
TIME_BUDGET_SECONDS = 10.0
PACED_BUDGET_SECONDS = 2.0
# A drain takes the bot's rate-limit slots this far ahead for one batch and sends each
# message at its slot; it sleeps at most this long between batches.
SLOT_HORIZON_SECONDS = 0.25
PACE_LEAD_SECONDS = 0.05
# Answers arriving within this long of the first are recorded by one statement.
RECORD_GATHER_SECONDS = 0.05


def outbound_messages_drain(bot_id: int, *, batch_size: int | None = None, extra: bool = False) -> DrainReport:
    """Send the bot's due messages, a batch at a time, until none is left, a wait holds the
    bot (a 429, an open circuit) or the time budget is spent; a continuation then follows.

    A drain woken by `wake_drain()` holds the bot's wake-up key while it runs, so that a burst
    wakes no second one; an `extra` drain (fanned out while the bot has room) does not."""
    if extra:
        wakeups.release(extra_drain_key(bot_id))
    bot, circuit = selectors.bot_and_circuit(bot_id)
    report = DrainReport()
    if bot is None:
        if not extra:
            wakeups.release(drain_key(bot_id))
        return report
    size = batch_size or send_batch_size(bot)
    lease = timedelta(seconds=settings.DOVECOTE_SEND_LEASE_SECONDS)
    worker = worker_id()
    started = time.monotonic()
    holds_key = not extra
    circuit_fresh = True  # read with the bot
    while True:
        if holds_key:
            wakeups.renew(drain_key(bot_id))
        if not circuit_fresh:
            circuit = selectors.bot_circuit(bot_id)  # the last batch's outcomes may have moved it
        circuit_fresh = False
        messages = _claim_due(bot, circuit, worker=worker, lease=lease, size=size)
        if not messages:
            if not holds_key:
                return report
            # Let go of the key, then look once more: a message committed while it was
            # still held woke nobody, so this drain must see it.
            wakeups.release(drain_key(bot_id))
            holds_key = False
            continue
        failpoint("after_claim")
        report.batches += 1
        full = len(messages) == size
        for message in messages:
            rows.attach_related(message, "bot", bot)
        ready = _drop_expired_and_vetoed(messages, worker=worker, report=report)
        # `held`: until when (time.monotonic()) the bot can take no more sends, or None.
        go, held = _take_slots(bot, ready, worker=worker, report=report)
        if full and held is None and all(delay <= ratelimit.SLOT_TOLERANCE_SECONDS for _, delay in go):
            # More may be due and the bot has room: let another worker process take the
            # next batch while this one sends. A bot at its rate limit is paced by one drain.
            fan_out_drain(bot_id)
        # A circuit with failures to forget: this batch's successes must reset it.
        dirty = circuit is not None and not (circuit.state == CircuitState.CLOSED and circuit.consecutive_failures == 0)
        held = _send(bot, go, worker=worker, report=report, held=held, circuit_dirty=dirty)
        elapsed = time.monotonic() - started
        wait = None if held is None else max(0.0, held - time.monotonic())
        if wait is not None and (not holds_key or wait > SLOT_HORIZON_SECONDS or elapsed > PACED_BUDGET_SECONDS):
            # Telegram (a 429) or the limiter holds the bot for longer than a pause between
            # batches (or this drain is not the one that paces the bot): come back then.
            # Each deferred message has its own wake-up, but the rest of the backlog, and the
            # next message of a chat whose message just went, have only this one.
            report.continuation = min(wait, policy.MAX_BROKER_COUNTDOWN_SECONDS)
            continue_drain(bot_id, report.continuation, holds_key=holds_key)
            return report
        if wait is not None:
            # The bot's next slots are this close: pace here, and claim the next batch a
            # little before they come, so that no slot passes unused while it is prepared.
            time.sleep(max(0.0, wait - PACE_LEAD_SECONDS))
        elif elapsed > TIME_BUDGET_SECONDS:
            # Also when the batches are not full: a steady trickle would keep it forever.
            report.continuation = 0.0
            continue_drain(bot_id, 0.0, holds_key=holds_key)
            return report


def _claim_due(bot, circuit, *, worker: str, lease: timedelta, size: int, bulk: bool = False) -> list[OutboundMessage]:
    """A batch of the bot's due messages of one lane (`bulk`: its broadcasts), claimed
    (none while its circuit is not closed)."""
    with uncommitted("before_claim_commit"):
        messages = transitions.claim_batch(
            bot_id=bot.pk,
            worker=worker,
            lease=lease,
            limit=size,
            bulk=bulk,
        )
        if messages:
            failpoint("before_claim_commit")
    return messages


def send_batch_size(bot, *, bulk: bool = False) -> int:
    """How many of a bot's messages one batch claims and sends: DOVECOTE_DRAIN_BATCH_SIZE,
    or as many slots as the bot's rate limit gives within a batch's slot horizon when that
    is more (a paid broadcast bot at 1,000/s: policy.MAX_SEND_BATCH, and a broadcast's batch
    up to policy.MAX_BULK_BATCH), or that most with the limiter off. A batch's statements
    are shared by more messages; a bot at Telegram's default 30/s keeps the default 8 (its
    horizon holds 7.5 slots: a bigger batch would claim messages only to put them back)."""
    size = settings.DOVECOTE_DRAIN_BATCH_SIZE
    if size <= 1:
        return size
    most = policy.MAX_BULK_BATCH if bulk else policy.MAX_SEND_BATCH
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        room = most
    else:
        room = math.ceil(bot.rate_limit * (BULK_SLOT_HORIZON_SECONDS if bulk else SLOT_HORIZON_SECONDS))
    return max(size, min(most, room))


def _drop_expired_and_vetoed(
    messages: list[OutboundMessage], *, worker: str, report: DrainReport
) -> list[OutboundMessage]:
    """Cancel claimed messages that expired or that the relevance check vetoes, as the
    single send does; returns the others."""
    now = timezone.now()
    ready: list[OutboundMessage] = []
    for message in messages:
        current_trace_id.set(message.trace_id)
        stop = cancel_reason(message, now=now)
        if stop is None:
            ready.append(message)
        elif transitions.cancel_claimed(message, worker=worker, reason=stop[0], error_class=stop[1]):
            report.cancelled += 1
    return ready


def _take_slots(
    bot, messages: list[OutboundMessage], *, worker: str, report: DrainReport, horizon: float = SLOT_HORIZON_SECONDS
) -> tuple[list[tuple[OutboundMessage, float]], float | None]:
    """The bot's next rate-limit slots for the batch: (message, seconds until its slot) for
    the messages that go in it, and how long until the bot can take more (None: at once).

    The drain takes the bot's slots within SLOT_HORIZON_SECONDS, all at once; `_send` sends
    each message at its slot. A message without a slot goes back to waiting, still due, for
    the drain's next batch."""
    try:
        return _slots_from_limiter(bot, messages, worker=worker, report=report, horizon=horizon)
    except ratelimit.LIMITER_ERRORS as exc:
        return [], _limiter_unreachable(messages, worker=worker, report=report, exc=exc)


def _slots_from_limiter(
    bot, messages: list[OutboundMessage], *, worker: str, report: DrainReport, horizon: float
) -> tuple[list[tuple[OutboundMessage, float]], float | None]:
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        # Only a 429's pause applies: one look for the whole batch.
        paused = ratelimit.bot_paused_for(bot.pk)
        if paused <= 0:
            return [(m, 0.0) for m in messages], None
        longest = _hold([(m, ratelimit.Wait(paused)) for m in messages], worker=worker, report=report)
        return [], None if longest is None else time.monotonic() + longest
    # A chat that took its message less than its limit ago waits without spending a slot
    # of the whole bot (as the single send tests the chat first).
    waits = ratelimit.chat_waits(bot_id=bot.pk, chat_ids=[limited_chat_id(m) for m in messages])
    busy = [(m, ratelimit.Wait(w)) for m, w in zip(messages, waits, strict=True) if w > 0]
    if busy:
        _hold(busy, worker=worker, report=report)
        waiting = {m.pk for m, _ in busy}
        messages = [m for m in messages if m.pk not in waiting]
    if not messages:
        return [], None
    delays = ratelimit.reserve_slots(bot.pk, bot.rate_limit, len(messages), horizon=horizon)
    go = list(zip(messages, delays, strict=False))
    unslotted = messages[len(delays) :]
    for message in unslotted:
        transitions.release(message, worker=worker, next_attempt_at=message.next_attempt_at)
    if unslotted:
        # The bot's slots are taken beyond the horizon, or a 429 pauses it.
        paused = ratelimit.bot_paused_for(bot.pk)
        return go, time.monotonic() + (paused if paused > 0 else (delays[-1] if delays else horizon))
    if delays and delays[-1] > ratelimit.SLOT_TOLERANCE_SECONDS:
        return go, time.monotonic() + delays[-1]
    return go, None


# When Redis, which holds the limiter, does not answer, the claimed messages go back to
# waiting and are looked at again after this long.
LIMITER_RETRY_SECONDS = 1.0


def _limiter_unreachable(
    messages: list[OutboundMessage], *, worker: str, report: DrainReport, exc: BaseException
) -> float | None:
    logger.warning("rate limiter unreachable (%s): %d message(s) go back to waiting", exc, len(messages))
    longest = _hold([(m, ratelimit.Wait(LIMITER_RETRY_SECONDS)) for m in messages], worker=worker, report=report)
    return None if longest is None else time.monotonic() + longest


def _hold(waits: list[tuple[OutboundMessage, ratelimit.Wait]], *, worker: str, report: DrainReport) -> float | None:
    """Messages that must wait go back to waiting, due after the wait (in the row, so that
    no drain takes them early), each with a wake-up of its own but broadcasts, whose drain
    comes back for them; returns the longest wait."""
    if not waits:
        return None
    now = timezone.now()
    for message, wait in waits:
        if transitions.release(message, worker=worker, next_attempt_at=now + timedelta(seconds=wait.seconds)):
            report.deferred += 1
            if not wait.beyond_horizon and not message.broadcast:
                dispatch(message.pk, countdown=wait.seconds, slot_reserved=wait.slot_reserved)
            # Beyond the horizon the row holds the wait and the sweeper dispatches it when due.
    return max(wait.seconds for _, wait in waits)


def _send(
    bot,
    go: list[tuple[OutboundMessage, float]],
    *,
    worker: str,
    report: DrainReport,
    held: float | None,
    circuit_dirty: bool,
    next_in_chat: bool = False,
    entries: dict[int, ratelimit.Entry] | None = None,
    answer_wait: float | None = None,
) -> float | None:
    """Send the batch: at each slot, the chat's limit and the bot's window are checked as the
    single send checks them, the attempt rows are written (one statement, one commit, before
    any request) and the requests go out together; the answers are recorded as they come.
    Returns until when the bot is held (time.monotonic()), or None.

    `answer_wait`: once every request is out, wait this long for the answers at most; those
    still out are then recorded by this process's late-answers thread (sending/late.py), so
    that a slow Bot API does not hold the caller (a router sending what it routed)."""
    # Each send's place in the bot's window, from its slot until its answer (ratelimit.leave);
    # some may come with it already (`_take_turns`).
    answers = InFlight(bot, worker=worker, report=report, held=held, next_in_chat=next_in_chat, entries=entries)
    try:
        return _send_in_flight(bot, go, answers, circuit_dirty=circuit_dirty, answer_wait=answer_wait)
    except BaseException:
        # Those still out are this process's no more: the sweeper's, or an outage's take-up's.
        answers.let_go(set(answers.holding))
        raise


def _send_in_flight(
    bot, go: list[tuple[OutboundMessage, float]], answers: InFlight, *, circuit_dirty: bool, answer_wait: float | None
) -> float | None:
    worker, report = answers.worker, answers.report
    start = time.monotonic()
    schedule = sorted(go, key=lambda item: item[1])
    sent_before = report.sent
    hand_off_at = None if answer_wait is None else start + answer_wait
    while schedule or answers.pending:
        now = time.monotonic()
        due = [m for m, delay in schedule if start + delay <= now + ratelimit.SLOT_TOLERANCE_SECONDS]
        if due:
            schedule = schedule[len(due) :]
            due, answers.held = _window(
                bot, due, worker=worker, report=report, held=answers.held, entries=answers.entries
            )
            answers.hold(due)
            begun = transitions.begin_attempts(due, worker=worker)
            answers.attempts.update(begun)
            answers.let_go({m.pk for m in due} - begun.keys())
            ratelimit.leave(
                [answers.entries.pop(m.pk) for m in due if m.pk not in begun and m.pk in answers.entries], sent=False
            )
            failpoint("before_request")
            going = [message for message in due if message.pk in begun]
            calls = [(m.method, {"chat_id": m.chat_id, **m.payload}) for m in going]
            started = botapi.submit_many(token=bot.token, base_url=bot.api_base_url, calls=calls, bot_name=bot.name)
            answers.add(zip(started, going, strict=True), deadline=time.monotonic() + botapi.send_timeout())
            continue
        next_slot = start + schedule[0][1] if schedule else None
        if not answers.pending:
            time.sleep(max(0.0, next_slot - now))  # type: ignore[operator] - schedule is not empty
            continue
        if next_slot is None and hand_off_at is not None and now >= hand_off_at:
            # Every request is out and the answers are slow: recorded by the late-answers
            # thread, and this caller goes on.
            answers.circuit_dirty = circuit_dirty and report.sent == sent_before
            late_answers.take(answers)
            return answers.held
        until = min(t for t in (answers.deadline, next_slot, hand_off_at) if t is not None)
        done, _ = concurrent.futures.wait(
            answers.pending, timeout=max(0.0, until - now), return_when=concurrent.futures.FIRST_COMPLETED
        )
        if done and answers.pending - done:
            # Gather the answers that come soon after, to record them in one statement; a
            # slow request does not keep the others' outcomes waiting for more than this.
            more, _ = concurrent.futures.wait(answers.pending - done, timeout=RECORD_GATHER_SECONDS)
            done |= more
        answers.settle(done)
    if circuit_dirty and report.sent > sent_before:
        circuits.record_success(circuits.bot_scope(bot.pk))
    failpoint("after_record")
    return answers.held


def _window(
    bot,
    messages: list[OutboundMessage],
    *,
    worker: str,
    report: DrainReport,
    held: float | None,
    entries: dict[int, ratelimit.Entry],
) -> tuple[list[OutboundMessage], float | None]:
    """At their slot: the chat's own limit, a 429 pause and the bot's window, as the single
    send checks them with a reserved slot; each one that may go gets its window entry in
    `entries`. Those refused wait with a wake-up of their own."""
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        return messages, held
    go: list[OutboundMessage] = []
    waits: list[tuple[OutboundMessage, ratelimit.Wait]] = []
    for n, message in enumerate(messages):
        if message.pk in entries:
            go.append(message)  # its turn came with its entry (ratelimit.take_now)
            continue
        try:
            wait = ratelimit.acquire(
                bot_id=bot.pk,
                bot_rate=bot.rate_limit,
                chat_id=limited_chat_id(message),
                slot_reserved=True,
            )
        except ratelimit.LIMITER_ERRORS as exc:
            # This one and the rest of the slot wait; those already out are recorded as usual.
            logger.warning("rate limiter unreachable (%s): %d message(s) go back to waiting", exc, len(messages) - n)
            waits += [(m, ratelimit.Wait(LIMITER_RETRY_SECONDS)) for m in messages[n:]]
            break
        if wait.seconds > 0:
            waits.append((message, wait))
        else:
            go.append(message)
            if wait.entry is not None:
                entries[message.pk] = wait.entry
    longest = _hold(waits, worker=worker, report=report)
    if longest is not None:
        held = max(held or 0.0, time.monotonic() + longest)
    return go, held


# --- the bulk lane ----------------------------------------------------------------------

# A broadcast drain books the bot's slots this far ahead for one batch, and only while none
# is booked ahead: a reply that comes meanwhile waits at most this long behind it.
BULK_SLOT_HORIZON_SECONDS = 0.25
# It waits for the bot's next free slot where it is only this long; a longer wait (its own
# batch's slots still to pass, replies taking the bot's rate) hands the worker back, and
# its continuation comes this long before the slot, so that a worker's hop does not make
# it late for it.
BULK_WAIT_IN_PLACE_SECONDS = 0.1
# A broadcast drain that finds every broadcast drain its host may run at work comes back
# this much later.
BULK_PERMIT_RETRY_SECONDS = 0.25


def bulk_permits_key() -> str:
    """The permits of this host's broadcast drains (DOVECOTE_BULK_DRAINS_PER_HOST)."""
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:bulk-drains:{socket.gethostname()}"


def outbound_broadcasts_drain(bot_id: int, *, timer: bool = False) -> DrainReport:
    """Send the bot's due broadcast messages a batch at a time, at the bot's rate less what
    its replies take: a batch books slots only while no reply has booked one ahead
    (ratelimit.take_now with `bulk`). A short wait for a slot is waited out; a longer one, the
    time budget, a 429 or an open circuit end it with a continuation, and with nothing due it sets
    a timer for its bot's next broadcast message. It holds the bot's broadcast wake-up key and one
    of its host's permits. `timer`: a wake-up for later, which does nothing if the key is held."""
    report = DrainReport()
    key = bulk_drain_key(bot_id)
    if timer and not wakeups.take(key):
        return report
    worker = worker_id()
    permits, limit = bulk_permits_key(), settings.DOVECOTE_BULK_DRAINS_PER_HOST
    if not wakeups.take_permit(permits, worker, limit=limit):
        report.continuation = BULK_PERMIT_RETRY_SECONDS
        continue_bulk_drain(bot_id, report.continuation, holds_key=True)
        return report
    try:
        return _drain_broadcasts(bot_id, worker=worker, report=report, permits=permits, limit=limit)
    finally:
        wakeups.return_permit(permits, worker)


def _drain_broadcasts(bot_id: int, *, worker: str, report: DrainReport, permits: str, limit: int) -> DrainReport:
    key = bulk_drain_key(bot_id)
    bot, circuit = selectors.bot_and_circuit(bot_id)
    if bot is None:
        wakeups.release(key)
        return report
    size = send_batch_size(bot, bulk=True)
    lease = timedelta(seconds=settings.DOVECOTE_SEND_LEASE_SECONDS)
    started = time.monotonic()
    holds_key = True
    circuit_fresh = True
    while True:
        if holds_key:
            wakeups.renew(key)
        wakeups.take_permit(permits, worker, limit=limit)
        try:
            wait = ratelimit.bulk_wait(bot.pk, bot.rate_limit)
        except ratelimit.LIMITER_ERRORS as exc:
            logger.warning("rate limiter unreachable (%s): broadcast drain of bot %s waits", exc, bot_id)
            wait = LIMITER_RETRY_SECONDS
        if wait > BULK_WAIT_IN_PLACE_SECONDS or time.monotonic() - started > TIME_BUDGET_SECONDS:
            return _continue_broadcasts(bot_id, wait, report=report, holds_key=holds_key)
        if wait > 0:
            time.sleep(wait)
        if not circuit_fresh:
            circuit = selectors.bot_circuit(bot_id)
        circuit_fresh = False
        messages = _claim_due(bot, circuit, worker=worker, lease=lease, size=size, bulk=True)
        if not messages:
            if holds_key:
                # Let go of the key, then look once more (as the replies' drain does).
                wakeups.release(key)
                holds_key = False
                continue
            _wake_for_next_broadcast(bot_id)
            return report
        failpoint("after_claim")
        report.batches += 1
        for message in messages:
            rows.attach_related(message, "bot", bot)
        ready = _drop_expired_and_vetoed(messages, worker=worker, report=report)
        go, held, entries = _take_turns(bot, ready, worker=worker, report=report, bulk=True)
        dirty = circuit is not None and not (circuit.state == CircuitState.CLOSED and circuit.consecutive_failures == 0)
        held = _send(bot, go, worker=worker, report=report, held=held, circuit_dirty=dirty, entries=entries)
        wait = None if held is None else max(0.0, held - time.monotonic())
        if wait is not None and wait > BULK_WAIT_IN_PLACE_SECONDS:
            return _continue_broadcasts(bot_id, wait, report=report, holds_key=holds_key)


def _continue_broadcasts(bot_id: int, wait: float, *, report: DrainReport, holds_key: bool) -> DrainReport:
    report.continuation = min(max(0.0, wait - BULK_WAIT_IN_PLACE_SECONDS), policy.MAX_BROKER_COUNTDOWN_SECONDS)
    continue_bulk_drain(bot_id, report.continuation, holds_key=holds_key)
    return report


def _wake_for_next_broadcast(bot_id: int) -> None:
    """The drain stops: a timer for the bot's next broadcast message to fall due within a
    broker countdown. One due already and not claimed waits for what holds it (an open
    circuit, its ramp, another drain) and the sweeper; a later one, for the sweeper."""
    due = selectors.next_broadcast_due(bot_id)
    if due is None:
        return
    countdown = (due - timezone.now()).total_seconds()
    if 0 < countdown <= policy.MAX_BROKER_COUNTDOWN_SECONDS:
        wake_bulk_drain(bot_id, countdown=countdown)


# The inline send takes the bot's slots this far ahead at most: the rest of a batch goes to
# the bot's drain rather than hold the router that wrote it.
INLINE_HORIZON_SECONDS = 0.05
# ... and waits this long for Telegram's answers at most; slower ones are recorded by the
# late-answers thread (sending/late.py), so a slow Bot API never holds up routing.
INLINE_ANSWER_WAIT_SECONDS = 0.5


def outbound_messages_send_now(
    bot_id: int, message_ids: list[int], *, bot=None, claimed: dict[int, OutboundMessage] | None = None
) -> list[int]:
    """Send these just-committed messages of one bot from this worker, as one batch of the
    drain: one claim, one statement of attempt rows, the requests together, the answers in
    one statement (outbox.sending.single.send_held). `claimed`: those of them written
    already claimed by this worker (transitions.write_claimed), as written; they need no
    claim. Only what the bot has room for now goes; nothing waits here. Returns the ids it
    did not send (not due, an earlier message of their chat still open, the bot's circuit
    not closed, claimed elsewhere, or no slot yet) for the caller to hand to the drain."""
    claimed = claimed or {}
    if bot is None:
        bot = selectors.bot_model().objects.filter(pk=bot_id).first()
    if bot is None:
        # No bot to send with: those written claimed go back to waiting, as a drain's would.
        worker = worker_id()
        for pk in message_ids:
            if pk in claimed:
                transitions.release(claimed[pk], worker=worker, next_attempt_at=claimed[pk].next_attempt_at)
        return message_ids
    # A batch at a time: more requests in flight than the HTTP client has connections only
    # cost CPU in its pool (its bookkeeping grows with the square of what waits in it).
    size = send_batch_size(bot)
    left: list[int] = []
    for start in range(0, len(message_ids), size):
        left += _send_now(bot, message_ids[start : start + size], claimed)
    return left


def _send_now(bot, message_ids: list[int], written_claimed: dict[int, OutboundMessage]) -> list[int]:
    bot_id = bot.pk
    worker = worker_id()
    lease = timedelta(seconds=settings.DOVECOTE_SEND_LEASE_SECONDS)
    messages = [written_claimed[pk] for pk in message_ids if pk in written_claimed]
    to_claim = [pk for pk in message_ids if pk not in written_claimed]
    if to_claim:
        with uncommitted("before_claim_commit"):
            claimed_now = transitions.claim_batch(
                bot_id=bot_id, worker=worker, lease=lease, limit=len(to_claim), ids=to_claim
            )
            if claimed_now:
                failpoint("before_claim_commit")
        messages = sorted(messages + claimed_now, key=lambda m: (m.next_attempt_at, m.pk))
    if messages:
        failpoint("after_claim")
    for message in messages:
        rows.attach_related(message, "bot", bot)
    report = DrainReport()
    ready = _drop_expired_and_vetoed(messages, worker=worker, report=report)
    go, held, entries = _take_turns(bot, ready, worker=worker, report=report)
    claimed = {m.pk for m in messages}
    slotted = {m.pk for m, _ in go}
    # Those without a slot went back to waiting: the drain paces them.
    left = [pk for pk in message_ids if pk not in claimed] + [m.pk for m in ready if m.pk not in slotted]
    dirty = any(m.circuit_dirty for m in messages)
    _send(
        bot,
        go,
        worker=worker,
        report=report,
        held=held,
        circuit_dirty=dirty,
        next_in_chat=True,
        entries=entries,
        # Answers of this bot already late: Telegram is slow for it now; do not wait at all.
        answer_wait=0.0 if late_answers.waiting_for(bot_id) else INLINE_ANSWER_WAIT_SECONDS,
    )
    return left


def _take_turns(
    bot, messages: list[OutboundMessage], *, worker: str, report: DrainReport, bulk: bool = False
) -> tuple[list[tuple[OutboundMessage, float]], float | None, dict[int, ratelimit.Entry]]:
    """`_take_slots` for the inline send, in one round trip to the limiter where it can
    (ratelimit.take_now): the sends whose slot is now come with their window entries, which
    `_window` would otherwise take at the slot one round trip each. `bulk`: a broadcast
    drain's batch, the slots within BULK_SLOT_HORIZON_SECONDS only while no reply waits
    for one, all of them going at once (a busy chat's message waits in its row)."""
    horizon = BULK_SLOT_HORIZON_SECONDS if bulk else INLINE_HORIZON_SECONDS
    try:
        turns = ratelimit.take_now(
            bot.pk, bot.rate_limit, [limited_chat_id(m) for m in messages], horizon=horizon, bulk=bulk
        )
    except ratelimit.LIMITER_ERRORS as exc:
        return [], _limiter_unreachable(messages, worker=worker, report=report, exc=exc), {}
    if turns is None:
        # The limiter off, or a group's moving window: slots one by one (a broadcast's too,
        # without the replies' priority).
        go, held = _take_slots(bot, messages, worker=worker, report=report, horizon=horizon)
        return go, held, {}
    go: list[tuple[OutboundMessage, float]] = []
    busy: list[tuple[OutboundMessage, ratelimit.Wait]] = []
    entries: dict[int, ratelimit.Entry] = {}
    held: float | None = None
    for message, turn in zip(messages, turns, strict=True):
        if turn.kind == "chat":
            busy.append((message, ratelimit.Wait(turn.seconds)))
        elif turn.kind in ("none", "paused", "busy") or (bulk and turn.kind == "full"):
            # The bot's slots are taken beyond the horizon (a bulk batch: a reply waits for
            # the next one, or the window is full), or a 429 pauses it: still due, for the
            # drain.
            transitions.release(message, worker=worker, next_attempt_at=message.next_attempt_at)
            held = max(held or 0.0, time.monotonic() + turn.seconds)
        else:
            # "slot" and "full" take the window at their slot (`_window`), as `_take_slots`' do.
            go.append((message, turn.seconds if turn.kind == "slot" else 0.0))
            if turn.entry is not None:
                entries[message.pk] = turn.entry
    _hold(busy, worker=worker, report=report)
    if go and go[-1][1] > ratelimit.SLOT_TOLERANCE_SECONDS:
        held = max(held or 0.0, time.monotonic() + go[-1][1])
    return go, held, entries
