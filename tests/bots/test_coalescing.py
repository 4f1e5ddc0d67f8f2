"""Burst coalescing and the reply guard, in-process (real PostgreSQL, sandbox over HTTP), with
production's inline work: routing runs a message's auto-reply at once (the router's pass),
and a deferred run comes back as its task would (`execute`: one call of the run service),
its reply sent by that worker right after the commit. The end-to-end version with a real
worker is in tests/e2e/test_pipeline.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from bots import replies, transitions
from bots.models import ChatState, ConsumerRun, InboundUpdate, RunState
from outbox.models import OutboundMessage
from tests.bots.fakes import deliver, execute, message_update, receive, route, route_all, run_of, store

# Transactional: a run's reply leaves after its commit.
pytestmark = pytest.mark.django_db(transaction=True)

DEBOUNCE = 0.4
# A window no pause of a busy host between writing a burst and looking at it again outlasts:
# 0.4 s ran out once in a CI-style run beside another suite, and the run was due already.
LONG_WINDOW = 2.0


def wait_until_due(update) -> None:
    run = run_of(update, "auto_reply")
    time.sleep(max(0.0, (run.next_attempt_at - timezone.now()).total_seconds()) + 0.02)


@override_settings(DOVECOTE_REPLY_DEBOUNCE_SECONDS=LONG_WINDOW)
def test_three_messages_within_the_window_get_one_reply_and_a_later_fourth_its_own(bot, sandbox) -> None:
    burst = [
        store(bot, message_update(chat_id=4242, text=text, message_id=n))
        for n, text in enumerate(["Hi", "Still available?", "Delivery?"], start=1)
    ]

    # One router pass routes the burst: the earlier messages' runs finish at once, the
    # newest message's run answers for them once the chat is quiet.
    assert route_all(bot) == 3
    assert [run_of(u, "auto_reply").outcome for u in burst[:2]] == ["coalesced", "coalesced"]
    holder = run_of(burst[2], "auto_reply")
    assert holder.state == RunState.PENDING
    assert holder.attempts == 0  # waiting is not an attempt
    assert holder.next_attempt_at >= burst[2].received_at + timedelta(seconds=LONG_WINDOW)
    assert execute(burst[2], "auto_reply") == "not-due"
    assert not OutboundMessage.objects.exists()

    wait_until_due(burst[2])
    assert execute(burst[2], "auto_reply") == "done"
    assert run_of(burst[2], "auto_reply").outcome == "answered 3"
    assert sandbox.sent_texts(token=bot.token, chat_id=4242) == ["Echo: Hi\nStill available?\nDelivery?"]
    message = OutboundMessage.objects.get()
    assert message.idempotency_key == "chat:4242:auto_reply:upto:3"
    assert message.trace_id == burst[2].trace_id
    assert ChatState.objects.get(bot=bot, chat_id=4242).last_answered_message_id == 3

    fourth = receive(bot, message_update(chat_id=4242, text="Hello??", message_id=4))
    assert run_of(fourth, "auto_reply").state == RunState.PENDING  # deferred by the router's pass
    wait_until_due(fourth)
    assert execute(fourth, "auto_reply") == "done"
    assert sandbox.sent_texts(token=bot.token, chat_id=4242) == [
        "Echo: Hi\nStill available?\nDelivery?",
        "Echo: Hello??",
    ]


@override_settings(DOVECOTE_REPLY_DEBOUNCE_SECONDS=DEBOUNCE)
def test_a_router_pass_answers_a_quiet_chat_and_defers_a_busy_one_each_run_once(bot, sandbox, caplog) -> None:
    quiet = store(bot, message_update(chat_id=21, text="anyone?", message_id=1))
    InboundUpdate.objects.filter(pk=quiet.pk).update(received_at=timezone.now() - timedelta(seconds=10))
    busy = store(bot, message_update(chat_id=22, text="hi", message_id=1))

    with caplog.at_level("WARNING", logger="bots.runs"):
        assert route_all(bot) == 2

    # One router pass, each run settled once: the quiet chat's answered (and sent), the
    # busy one's deferred, and nothing logged as failed.
    assert run_of(quiet, "auto_reply").outcome == "answered 1"
    assert sandbox.sent_texts(token=bot.token, chat_id=21) == ["Echo: anyone?"]
    assert run_of(busy, "auto_reply").state == RunState.PENDING
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


@override_settings(DOVECOTE_REPLY_DEBOUNCE_SECONDS=DEBOUNCE)
def test_a_message_arriving_while_the_burst_waits_takes_the_burst_over(bot, sandbox) -> None:
    first = receive(bot, message_update(chat_id=5, text="one", message_id=10))
    assert run_of(first, "auto_reply").state == RunState.PENDING  # deferred by the router's pass
    time.sleep(DEBOUNCE / 2)
    second = receive(bot, message_update(chat_id=5, text="two", message_id=11))

    wait_until_due(first)
    assert execute(first, "auto_reply") == "done"
    assert run_of(first, "auto_reply").outcome == "coalesced"
    assert execute(second, "auto_reply") == "not-due"  # the chat is not quiet yet
    wait_until_due(second)
    assert execute(second, "auto_reply") == "done"
    assert sandbox.sent_texts(token=bot.token, chat_id=5) == ["Echo: one\ntwo"]


@override_settings(DOVECOTE_REPLY_DEBOUNCE_SECONDS=DEBOUNCE)
def test_a_chat_never_gets_a_second_answer_to_a_message_already_answered(bot, sandbox) -> None:
    early = store(bot, message_update(chat_id=6, text="early", message_id=1))
    late = receive(bot, message_update(chat_id=6, text="late", message_id=2))
    wait_until_due(late)
    assert execute(late, "auto_reply") == "done"
    assert sandbox.sent_texts(token=bot.token, chat_id=6) == ["Echo: early\nlate"]

    # The earlier message is routed last (its router was lost; the sweeper routes it): its
    # run, in the router, sends nothing more.
    route(early)
    assert run_of(early, "auto_reply").outcome == "coalesced"
    # A replayed holder run (its worker died after writing the answer) sends nothing new.
    ConsumerRun.objects.filter(pk=run_of(late, "auto_reply").pk).update(state=RunState.RETRY)
    assert execute(late, "auto_reply") == "done"
    assert run_of(late, "auto_reply").outcome == "answered"
    assert sandbox.sent_texts(token=bot.token, chat_id=6) == ["Echo: early\nlate"]
    assert OutboundMessage.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_workers_cannot_both_take_the_reply_guard(bot) -> None:
    start = threading.Barrier(4)
    won: list[bool] = []

    def worker() -> None:
        try:
            start.wait()
            won.append(transitions.mark_chat_answered(bot_id=bot.pk, chat_id=9, upto_message_id=3))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)

    assert sorted(won) == [False, False, False, True]
    assert not transitions.mark_chat_answered(bot_id=bot.pk, chat_id=9, upto_message_id=2)
    assert transitions.mark_chat_answered(bot_id=bot.pk, chat_id=9, upto_message_id=4)


@override_settings(DOVECOTE_REPLY_DEBOUNCE_SECONDS=0.1, DOVECOTE_REPLY_DELAY_RANGE="20,60")
def test_a_human_like_delay_is_drawn_once_per_message_within_the_range(bot) -> None:
    update = receive(bot, message_update(chat_id=11, text="hello", message_id=1))
    run = run_of(update, "auto_reply")
    assert run.state == RunState.PENDING  # deferred by the router's pass
    due = run.next_attempt_at
    assert update.received_at + timedelta(seconds=20.1) <= due <= update.received_at + timedelta(seconds=60.1)
    assert replies.reply_due_at(update) == due  # every re-run computes the same moment
    assert execute(update, "auto_reply") == "not-due"


@override_settings(DOVECOTE_REPLY_DEBOUNCE_SECONDS=0)
def test_without_a_debounce_each_message_is_answered_at_once(bot, sandbox) -> None:
    first = store(bot, message_update(chat_id=12, text="a", message_id=1))
    second = store(bot, message_update(chat_id=12, text="b", message_id=2))
    # Routed out of order (the first's router was lost; the sweeper routes it): both are
    # still answered, each once, and the guard stays at the newest.
    route(second)
    route(first)
    assert deliver(bot) == ["sent"]  # the second reply, after the chat's one message a second
    assert sorted(sandbox.sent_texts(token=bot.token, chat_id=12)) == ["Echo: a", "Echo: b"]
    assert ChatState.objects.get(bot=bot, chat_id=12).last_answered_message_id == 2
    assert [execute(u, "auto_reply") for u in (first, second)] == ["not-waiting", "not-waiting"]
