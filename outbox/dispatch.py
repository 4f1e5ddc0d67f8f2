"""Handing messages to workers: one message's task, or a wake-up of its bot's drain.

`dispatch` publishes after the row is committed and never raises: when the broker does not take
the task, the row stays due and the sweeper dispatches it (`redispatch`). A bot's drain is woken
through a coalesced wake-up key (core/wakeups.py); `kick_chat` hands a chat's next ordered
message on. Replies go through the bot's drain on `dovecote`, broadcasts through its broadcast
drain on `dovecote.bulk`, each with its own key. Why: docs/DESIGN.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from django.conf import settings

from core import wakeups
from core.publishing import publish
from outbox import policy, selectors, transitions
from outbox.models import OutboundMessage, State


def dispatch(
    message_id: int,
    *,
    bot_id: int | None = None,
    countdown: float = 0.0,
    slot_reserved: bool = False,
    bulk: bool = False,
) -> bool:
    """Hand a message to a worker. Failure to publish is logged, never raised: the row is
    committed and the sweeper dispatches whatever is overdue. `bulk` (a broadcast's message)
    wakes its bot's broadcast drain on the bulk queue, so that replies to people are not
    stuck behind thousands of notifications.

    Given its `bot_id`, a message due now wakes the bot's batched drain (sending/batch.py)
    instead of getting a task of its own; a wait or a reserved slot keeps the one-message
    task (and so does every message with DOVECOTE_DRAIN_BATCH_SIZE=1: no drain)."""
    if countdown > policy.MAX_BROKER_COUNTDOWN_SECONDS:
        return False  # the sweeper picks it up when due
    if bulk and bot_id is not None and drain_enabled():
        return wake_bulk_drain(bot_id, countdown=countdown)
    held = _held.get()
    if held is not None and bot_id is not None and countdown <= 0 and not slot_reserved and not bulk:
        held.append((message_id, bot_id))  # the caller sends it itself (holding, below)
        return True
    if bot_id is not None and countdown <= 0 and not slot_reserved and not bulk and drain_enabled():
        return wake_drain(bot_id)
    from outbox.tasks import send_outbound_message

    kwargs: dict[str, Any] = {"slot_reserved": True} if slot_reserved else {}
    task: Any = send_outbound_message
    if bulk:
        kwargs["bulk"] = True
        task = send_outbound_message.signature(queue=settings.CELERY_TASK_QUEUE_BULK)
    return publish(task, (message_id,), kwargs, countdown=countdown, what=f"message {message_id}")


class Held(list[tuple[int, int]]):
    """The (message id, bot id) a holding block kept back for its caller to send, those of
    them written already claimed by this worker (`claimed`, their rows as written: see
    `claims_on_write`), and what is to run once they are sent (`after_sends`)."""

    def __init__(self) -> None:
        super().__init__()
        self.claimed: dict[int, OutboundMessage] = {}
        self.after: list[Callable[[], None]] = []


_held: ContextVar[Held | None] = ContextVar("dovecote_held_dispatches", default=None)


@contextmanager
def holding() -> Iterator[Held]:
    """While the block runs, messages due now that `dispatch` would hand to the bot's drain
    are kept in the yielded list of (message id, bot id) instead: the caller, a worker that
    just wrote them, sends them itself right after (outbox.sending.single.send_held). A
    message the caller then cannot send goes to the drain as usual."""
    held = Held()
    token = _held.set(held)
    try:
        yield held
    finally:
        _held.reset(token)


def holding_now() -> bool:
    """Whether messages written now are kept back for their writer to send (`holding`)."""
    return _held.get() is not None


def claims_on_write(message: OutboundMessage) -> bool:
    """Whether a message about to be written may be written claimed by this worker
    (transitions.write_claimed: one statement instead of an INSERT and a claim): its writer
    is in a holding block, so it sends the message itself right after the commit, in a
    batch send (`drain_enabled`), and nothing makes it wait (no `send_at`, not a broadcast).
    Whether it is claimed then is the statement's to decide, as a claim would."""
    return holding_now() and not message.broadcast and message.send_at is None and drain_enabled()


def claims_on_write_all(messages: list[OutboundMessage]) -> bool:
    """`claims_on_write` for a batch written in one statement (transitions.write_many_claimed):
    each of them, all of one bot."""
    return len({m.bot_id for m in messages}) == 1 and all(claims_on_write(m) for m in messages)


def hand_claimed(message: OutboundMessage) -> None:
    """A message written claimed, now committed: to the holding block that sends it. When
    its transaction committed after the block had ended (an atomic block around it), it is
    let go (sending -> pending, no attempt) and handed on as any message is."""
    held = _held.get()
    if held is not None:
        held.append((message.pk, message.bot_id))
        held.claimed[message.pk] = message
        return
    if transitions.release(message, worker=message.lease_owner, next_attempt_at=message.next_attempt_at):
        message.state, message.lease_owner, message.lease_expires_at = State.PENDING, "", None
    dispatch(message.pk, bot_id=message.bot_id)


def after_sends(then: Callable[[], None]) -> None:
    """Run `then` once the messages the current holding block keeps back are sent (or
    handed on): bookkeeping a reply need not wait for. Outside a holding block, at once.
    A crash between the send and `then` leaves `then` undone, so it must be safe to skip."""
    held = _held.get()
    if held is None:
        then()
    else:
        held.after.append(then)


def kick_chat(message: OutboundMessage) -> None:
    """The chat's queue moved on: hand the next ordered message of this chat to a worker.
    Only ordered messages hold a chat up, so an unordered one (broadcasts) kicks nobody."""
    if not message.ordered:
        return
    next_id = selectors.next_open_message_in_chat(bot_id=message.bot_id, chat_id=message.chat_id)
    if next_id is not None and next_id != message.pk:
        dispatch(next_id, bot_id=message.bot_id)


def redispatch(pks: list[int], now: datetime, *, probe: bool = False) -> int:
    """The sweeper's redispatch: make the messages due now and hand them to workers through
    their bot's drains (`hand_on`), except a circuit's probe, which goes alone. Returns how
    many were handed on."""
    due = [pk for pk in pks if transitions.make_due(pk, now=now)]
    if probe:
        return sum(1 for pk in due if dispatch(pk))
    return hand_on(due, drained=True)


def hand_on(pks: list[int], *, drained: bool = False) -> int:
    """Hand these waiting messages to workers: a broadcast's to its bot's broadcast drain
    (one wake-up per bot: a live drain takes them in turn; a lost one's key expires within
    seconds and the next sweep wakes a new one), never to the replies' queue; the others a
    task each or, `drained`, one wake-up of their bot's drain. A task each suits a message
    released from a dead worker (its drain's key may stand a few seconds more) or resent by
    an operator. Without the drain's machinery, a task each. Returns how many were handed on."""
    if not drain_enabled():
        return sum(1 for pk in pks if dispatch(pk))
    handed = 0
    bulk: dict[int, int] = {}
    drains: dict[int, int] = {}
    for pk, bot_id, broadcast in OutboundMessage.objects.filter(pk__in=pks).values_list("pk", "bot_id", "broadcast"):
        if broadcast:
            bulk[bot_id] = bulk.get(bot_id, 0) + 1
        elif drained:
            drains[bot_id] = drains.get(bot_id, 0) + 1
        elif dispatch(pk):
            handed += 1
    handed += sum(n for bot_id, n in bulk.items() if wake_bulk_drain(bot_id))
    return handed + sum(n for bot_id, n in drains.items() if wake_drain(bot_id))


# --- the drain's wake-up --------------------------------------------------------------


def drain_enabled() -> bool:
    """Whether a bot's messages go out through its drain, a batch at a time; with a batch
    size of 1, one message per task."""
    return settings.DOVECOTE_DRAIN_BATCH_SIZE > 1


def drain_key(bot_id: int) -> str:
    """The wake-up key the bot's pacing drain holds while it runs."""
    return wakeups.key("drain", bot_id)


def extra_drain_key(bot_id: int) -> str:
    """The key of the one extra drain a full batch may fan out."""
    return wakeups.key("drain-extra", bot_id)


def wake_drain(bot_id: int, *, countdown: float = 0.0) -> bool:
    """Have a drain of this bot run (after `countdown`) unless one is queued or running:
    the wake-up key says so, and the running drain lets go of it only when it finds nothing
    more to send. Never raises: when the broker (Redis) is down the messages stay due in
    their rows and the sweeper dispatches them.

    A drain lost with its worker or its broker message stops renewing the key, which then
    expires (wakeups.KEY_TTL_MS); until then wake-ups, the sweeper's too, trust it. The
    sweeper's next tick wakes a new one: recovery never starts a second pacer for a bot
    whose drain is alive."""
    woken = wakeups.wake(drain_key(bot_id), lambda: _publish_drain(bot_id, countdown=countdown), countdown=countdown)
    return woken is True


def fan_out_drain(bot_id: int) -> None:
    """One more drain of this bot, beside the one that holds the wake-up key, while the bot
    has room: at most one queued at a time (its own key, deleted as it starts)."""
    wakeups.wake(extra_drain_key(bot_id), lambda: _publish_drain(bot_id, extra=True))


def continue_drain(bot_id: int, countdown: float, *, holds_key: bool) -> None:
    """The drain's continuation: it inherits the wake-up key (kept alive until it runs), or,
    from a drain without the key, it is an ordinary wake-up."""
    wakeups.hand_over(
        drain_key(bot_id), lambda: _publish_drain(bot_id, countdown=countdown), holds_key=holds_key, countdown=countdown
    )


def _publish_drain(bot_id: int, countdown: float = 0.0, *, extra: bool = False) -> bool:
    from outbox.tasks import drain_bot

    kwargs = {"extra": True} if extra else {}
    return publish(drain_bot, (bot_id,), kwargs, countdown=countdown, what=f"drain of bot {bot_id}")


# --- the broadcast drain's wake-up -----------------------------------------------------


def bulk_drain_key(bot_id: int) -> str:
    """The wake-up key the bot's broadcast drain holds while it is queued or runs."""
    return wakeups.key("drain-bulk", bot_id)


def wake_bulk_drain(bot_id: int, *, countdown: float = 0.0) -> bool:
    """Have the bot's broadcast drain run unless one is queued or running (as `wake_drain`).
    Later (`countdown`, a broadcast's send_at, a deferred message falling due): a timer that
    takes the key only when it runs, so that the key does not keep a broadcast due before
    then waiting for it. Past a broker countdown, nothing: the sweeper wakes it when due."""
    if countdown > policy.MAX_BROKER_COUNTDOWN_SECONDS:
        return False
    if countdown > 0:
        return _publish_bulk_drain(bot_id, countdown=countdown, timer=True)
    return wakeups.wake(bulk_drain_key(bot_id), lambda: _publish_bulk_drain(bot_id)) is True


def continue_bulk_drain(bot_id: int, countdown: float, *, holds_key: bool) -> None:
    """The broadcast drain's continuation, as `continue_drain`."""
    wakeups.hand_over(
        bulk_drain_key(bot_id),
        lambda: _publish_bulk_drain(bot_id, countdown=countdown),
        holds_key=holds_key,
        countdown=countdown,
    )


def _publish_bulk_drain(bot_id: int, countdown: float = 0.0, *, timer: bool = False) -> bool:
    from outbox.tasks import drain_broadcasts

    task = drain_broadcasts.signature(queue=settings.CELERY_TASK_QUEUE_BULK)
    kwargs = {"timer": True} if timer else {}
    return publish(task, (bot_id,), kwargs, countdown=countdown, what=f"broadcast drain of bot {bot_id}")
