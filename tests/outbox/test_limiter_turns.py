"""The limiter's one-round-trip turn for a worker sending what it just wrote
(ratelimit.take_now): the answers of `chat_waits`, `reserve_slots` and `acquire` at the
slot, from the same Redis keys, so that every other send - the drain's, a task's - keeps
counting what a turn took. Real Redis; the inline sends through the sandbox."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.test import override_settings

from bots.inbox import inbox_update_store
from bots.routing import inbox_updates_route
from core import connections
from outbox import ratelimit
from outbox.models import OutboundMessage, State
from tests.bots.fakes import message_update

pytestmark = pytest.mark.django_db


def kinds(turns: list[ratelimit.Turn] | None) -> list[str]:
    assert turns is not None
    return [turn.kind for turn in turns]


def test_a_send_whose_slot_is_now_goes_holding_its_chat_and_a_place_in_the_bots_window(bot) -> None:
    # A 2/s bot, so that a loaded host's pauses between these calls stay far inside the margins.
    turns = ratelimit.take_now(bot.pk, 2, [71, 72, None], horizon=0.6)

    # One slot of the bot is now; the next is 0.5 s away (within the horizon), the third not.
    assert kinds(turns) == ["go", "slot", "none"]
    assert turns[0].entry is not None
    assert turns[1].entry is None
    assert 0.45 < turns[1].seconds < 0.55  # slots are 1 / (rate x PACING) apart
    # Every other send sees what the turn took: the chat's gate and the bot's next slots.
    assert 0.5 < ratelimit.chat_wait(bot_id=bot.pk, chat_id=71) <= 1.0
    assert ratelimit.chat_wait(bot_id=bot.pk, chat_id=72) == 0.0  # its slot is held, not its chat
    kind, seconds = ratelimit.reserve_slot(bot.pk, 2, horizon=2.0)
    assert (kind, seconds > 0.6) == ("reserved", True)
    ratelimit.leave([turns[0].entry])


def test_a_busy_chat_spends_no_slot_of_the_bot(bot) -> None:
    busy = ratelimit.acquire(bot_id=bot.pk, bot_rate=1000, chat_id=81)
    ratelimit.leave([busy.entry])

    turns = ratelimit.take_now(bot.pk, 30, [81, 81, 82], horizon=0.01)

    # The chat answered just now waits its second; the other chat takes the bot's one slot.
    assert kinds(turns) == ["chat", "chat", "go"]
    assert 0.9 < turns[0].seconds <= 1.0
    ratelimit.leave([turns[2].entry])


def test_two_sends_to_one_chat_in_one_turn_take_its_gate_once(bot) -> None:
    turns = ratelimit.take_now(bot.pk, 1000, [91, 91, 92], horizon=0.05)

    assert kinds(turns) == ["go", "chat", "go"]
    ratelimit.leave([t.entry for t in turns if t.entry])


def test_a_full_window_is_left_to_the_send_at_its_slot(bot) -> None:
    # Two sends of a 2/s bot are out, their answers not in: its window is full.
    out = [ratelimit._take(bot.pk, 2, None, check_pause=True)[2] for _ in range(2)]

    turns = ratelimit.take_now(bot.pk, 2, [None], horizon=0.05)

    assert kinds(turns) == ["full"]
    assert turns[0].seconds > 1.0  # the first entry leaves a second after its answer at the earliest
    ratelimit.leave(out)


def test_a_429_pause_holds_every_send_of_the_turn(bot) -> None:
    ratelimit.pause_bot(bot.pk, 2.0)

    turns = ratelimit.take_now(bot.pk, 1000, [101, None], horizon=0.05)

    assert kinds(turns) == ["paused", "paused"]
    assert 1.5 < turns[0].seconds <= 2.0
    assert ratelimit.chat_wait(bot_id=bot.pk, chat_id=101) == 0.0  # nothing was taken


def test_a_group_or_the_limiter_switched_off_takes_the_calls_one_by_one(bot, settings) -> None:
    assert ratelimit.take_now(bot.pk, 30, [11, -100123], horizon=0.05) is None  # a group's 20/min window
    settings.DOVECOTE_RATE_LIMITS_ENABLED = False
    assert ratelimit.take_now(bot.pk, 30, [11], horizon=0.05) is None


def limiter_calls() -> int:
    """The limiter's scripts run so far (Redis counts the commands inside a script too, so
    the chat lookups' PTTLs outside one are not told apart: the scripts are the calls).
    Server-wide counts: read from a Redis of the test's own (`own_redis`)."""
    stats = connections.redis_client().info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


@pytest.fixture
def own_redis() -> Iterator[None]:
    """A redis-server of this test's own, so that no other run's scripts are counted."""
    from tests.e2e.chaos import PrivateRedis, broker_at

    server = PrivateRedis()
    server.start()
    try:
        with broker_at(server.url):
            yield
    finally:
        server.stop()


@pytest.mark.django_db(transaction=True)
def test_an_inline_reply_takes_its_turn_and_leaves_the_window_in_two_limiter_calls(
    bot_factory, sandbox, own_redis
) -> None:
    fast = bot_factory(rate_limit=1000)
    with override_settings(DOVECOTE_INLINE_WORK=True):
        inbox_update_store(bot=fast, payload=message_update(chat_id=111, text="warm", message_id=1))
        inbox_updates_route(fast.pk)  # the scripts loaded, the connections open
        for n in range(2, 6):
            inbox_update_store(bot=fast, payload=message_update(chat_id=110 + n, text=f"m{n}", message_id=n))
        before = limiter_calls()
        assert inbox_updates_route(fast.pk) == 4
        calls = limiter_calls() - before

    assert sorted(sandbox.sent_texts(token=fast.token)) == [f"Echo: m{n}" for n in range(2, 6)] + ["Echo: warm"]
    assert set(OutboundMessage.objects.filter(bot=fast).values_list("state", flat=True)) == {State.SENT}
    # Four replies: one turn for the lot and one leave per gathered set of answers (at most
    # four), where the calls one by one made a reservation and four takes (and a chat lookup).
    assert 2 <= calls <= 5


def test_an_inline_send_whose_messages_another_worker_claimed_first_leaves_them_without_an_error(
    bot, caplog: pytest.LogCaptureFixture
) -> None:
    from datetime import timedelta

    from outbox import transitions
    from outbox.sending.batch import outbound_messages_send_now
    from outbox.services import outbound_message_enqueue

    message, _ = outbound_message_enqueue(bot_id=bot.pk, chat_id=61, payload={"text": "hi"}, idempotency_key="k61")
    assert transitions.claim(message.pk, worker="the-other-worker", lease=timedelta(seconds=60))

    # Nothing of the batch is left to claim: no turn to take, nothing sent, nothing raised.
    assert ratelimit.take_now(bot.pk, 30, [], horizon=0.05) == []
    with caplog.at_level("ERROR"):
        outbound_messages_send_now(bot.pk, [message.pk])
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    message.refresh_from_db()
    assert (message.state, message.lease_owner, message.attempts) == (State.SENDING, "the-other-worker", 0)


def explode_on_boom(message: OutboundMessage) -> str:
    """A project's relevance check with a bug: it raises on one message."""
    if message.payload.get("text") == "boom":
        raise RuntimeError("the relevance check failed")
    return ""


@override_settings(DOVECOTE_RELEVANCE_CHECK="tests.outbox.test_limiter_turns.explode_on_boom")
def test_an_inline_send_that_fails_hands_what_it_had_not_claimed_to_the_drain_not_the_sweeper(bot, sandbox) -> None:
    from core import wakeups
    from outbox.dispatch import drain_key
    from outbox.sending import batch, single
    from outbox.services import outbound_message_enqueue
    from tests.support import queued

    messages = [
        outbound_message_enqueue(
            bot_id=bot.pk, chat_id=620 + n, payload={"text": "boom" if n == 0 else f"n{n}"}, idempotency_key=f"b{n}"
        )[0]
        for n in range(10)
    ]
    wakeups.release(drain_key(bot.pk))  # as a worker holding them would find it: no drain coming

    # Its first batch (8 at 30/s) fails; the two it had not claimed go to the bot's drain.
    single.send_held([(m.pk, bot.pk) for m in messages])

    assert [t.name for t in queued()] == ["outbox.drain_bot"]
    assert batch.outbound_messages_drain(bot.pk).sent == 2
    assert sorted(sandbox.sent_texts(token=bot.token)) == ["n8", "n9"]


# --- the bulk lane: a broadcast's sends take what replies leave ----------------------------


def test_a_bulk_turn_books_the_slots_within_its_horizon_and_all_of_them_go_at_once(bot) -> None:
    turns = ratelimit.take_now(bot.pk, 30, [201, 202, 203, 204, 205, 206, 207, 208, 209], horizon=0.25, bulk=True)

    # A 30/s bot's slots are 35 ms apart: eight fit in a quarter second, each with its entry.
    assert kinds(turns) == ["go"] * 8 + ["none"]
    assert all(turn.entry is not None for turn in turns[:8])
    # A reply coming now is booked after them, not before.
    kind, seconds = ratelimit.reserve_slot(bot.pk, 30, horizon=1.0)
    assert (kind, 0.25 < seconds < 0.3) == ("reserved", True)
    ratelimit.leave([t.entry for t in turns if t.entry])


def test_a_bulk_turn_takes_nothing_while_a_reply_has_booked_a_slot_ahead(bot) -> None:
    reply = ratelimit.take_now(bot.pk, 30, [211, 212], horizon=0.05)
    assert kinds(reply) == ["go", "slot"]  # the second reply's slot is booked 35 ms ahead

    turns = ratelimit.take_now(bot.pk, 30, [213, 214], horizon=0.25, bulk=True)

    # Until the slot after the booked one, 70 ms from the replies' turn.
    assert kinds(turns) == ["busy", "busy"]
    assert 0.0 < turns[0].seconds <= 0.07
    assert 0.0 < ratelimit.bulk_wait(bot.pk, 30) <= 0.07
    # Nothing was booked by the bulk turn: the next reply's slot is that one.
    kind, seconds = ratelimit.reserve_slot(bot.pk, 30, horizon=1.0)
    assert (kind, 0.0 < seconds <= 0.07) == ("reserved", True)
    ratelimit.leave([t.entry for t in reply if t.entry])


def test_a_bulk_turn_books_nothing_while_the_bots_window_is_full(bot) -> None:
    held = [ratelimit.acquire(bot_id=bot.pk, bot_rate=2, chat_id=None, slot_reserved=True) for _ in range(2)]

    turns = ratelimit.take_now(bot.pk, 2, [223], horizon=0.25, bulk=True)

    # Two entries of a 2/s bot: the window is full for a second past their answers.
    assert kinds(turns) == ["full"]
    assert ratelimit.bulk_wait(bot.pk, 2) > 0.9
    kind, seconds = ratelimit.reserve_slot(bot.pk, 2, horizon=10.0)
    assert (kind, seconds < 0.6) == ("reserved", True)  # the bulk turn booked no slot
    ratelimit.leave([w.entry for w in held if w.entry])
