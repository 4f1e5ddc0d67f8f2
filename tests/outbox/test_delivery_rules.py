"""Idempotency, scheduling, cancellation, order within a chat, relevance, the shared limiter
and races between workers: services called in-process, the sandbox over HTTP."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from outbox import botapi, ratelimit, services
from outbox.models import ErrorClass, OutboundMessage, State
from outbox.sending import single
from tests.outbox.helpers import drive, enqueue
from tests.support import in_threads


def veto_stale(message: OutboundMessage) -> str:
    """A relevance check as a project would write one: the scenario moved on."""
    return "the order was already paid" if message.payload.get("text", "").startswith("Pay") else ""


@pytest.fixture
def no_limits(settings) -> None:
    settings.DOVECOTE_RATE_LIMITS_ENABLED = False
    settings.DOVECOTE_RETRY_BASE_SECONDS = 0.05
    settings.DOVECOTE_RETRY_MAX_SECONDS = 0.2


# --- idempotency -------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_same_key_twice_makes_one_row_and_one_message(bot, sandbox) -> None:
    first, created_first = services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=7, payload={"text": "pressed"}, idempotency_key="button:42"
    )
    again, created_again = services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=7, payload={"text": "pressed"}, idempotency_key="button:42"
    )
    drive(first.pk)
    drive(again.pk)

    assert (created_first, created_again) == (True, False)
    assert first.pk == again.pk
    assert OutboundMessage.objects.filter(bot=bot).count() == 1
    assert sandbox.sent_texts(token=bot.token) == ["pressed"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "other",
    [{"chat_id": 8}, {"payload": {"text": "pressed twice"}}, {"method": "sendDice", "payload": {"emoji": "🎲"}}],
    ids=["chat", "payload", "method"],
)
def test_the_same_key_for_another_call_is_a_conflict_not_a_replay(bot, sandbox, other) -> None:
    first, _ = services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=7, payload={"text": "pressed"}, idempotency_key="button:43"
    )
    call = {"bot_id": bot.pk, "chat_id": 7, "payload": {"text": "pressed"}, "idempotency_key": "button:43", **other}
    with pytest.raises(services.IdempotencyConflict) as conflict:
        services.outbound_message_enqueue(**call)
    drive(first.pk)

    assert conflict.value.message.pk == first.pk
    assert OutboundMessage.objects.filter(bot=bot).count() == 1
    assert sandbox.sent_texts(token=bot.token) == ["pressed"]
    # The same call again, with its keys in another order, is still a replay.
    again, created = services.outbound_message_enqueue(
        idempotency_key="button:43", payload={"text": "pressed"}, chat_id=7, bot_id=bot.pk
    )
    assert (again.pk, created) == (first.pk, False)


@pytest.mark.django_db
def test_a_message_written_before_the_conflict_check_replays_whatever_the_call(bot) -> None:
    first, _ = services.outbound_message_enqueue(bot_id=bot.pk, chat_id=7, payload={"text": "a"}, idempotency_key="old")
    OutboundMessage.objects.filter(pk=first.pk).update(request_fingerprint="")
    again, created = services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=7, payload={"text": "b"}, idempotency_key="old"
    )
    assert (again.pk, created) == (first.pk, False)


@pytest.mark.django_db
def test_an_idempotency_key_must_be_1_to_255_characters_without_control_characters(bot) -> None:
    # A NUL reached PostgreSQL and came back as a 500 (found by the API's property test).
    for key in ["", "x" * 256, "\x00", "order\n42", "unit\x1fsep", "del\x7f"]:
        with pytest.raises(services.MessageRejected):
            enqueue(bot, key=key)
    assert not OutboundMessage.objects.exists()
    # The characters just past the control ones are a key's own.
    for key in ["x" * 255, "space key", "tilde~", "\x80 and \u00a0", "ключ 🔑"]:
        enqueue(bot, key=key)
    assert OutboundMessage.objects.count() == 5


# --- send_at, expires_at, cancel ---------------------------------------------------------


@pytest.mark.django_db
def test_a_message_is_not_sent_before_its_send_at(bot, sandbox) -> None:
    send_at = timezone.now() + timedelta(seconds=1.2)
    message = enqueue(bot, send_at=send_at)

    early = single.outbound_message_send(message.pk)
    assert early.status == "not-due"
    assert not sandbox.calls(token=bot.token)

    _, message = drive(message.pk)
    assert message.state == State.SENT
    assert sandbox.calls(token=bot.token)[0]["at"] >= send_at.timestamp()


@pytest.mark.django_db
def test_an_expired_message_is_cancelled_with_its_reason_and_never_sent(bot, sandbox) -> None:
    message = enqueue(bot, expires_at=timezone.now() + timedelta(milliseconds=100))
    time.sleep(0.15)

    result, message = drive(message.pk)

    assert result.status == "expired"
    assert (message.state, message.last_error_class) == (State.CANCELLED, ErrorClass.EXPIRED)
    assert "expires_at" in message.cancel_reason
    assert not sandbox.calls(token=bot.token)


@pytest.mark.django_db
def test_cancel_works_while_pending_and_is_refused_once_sent(bot, sandbox) -> None:
    waiting = enqueue(bot, chat_id=1)
    sent = enqueue(bot, chat_id=2)
    drive(sent.pk)

    assert services.outbound_message_cancel(waiting.pk, reason="scenario changed") is True
    assert services.outbound_message_cancel(sent.pk, reason="too late") is False
    waiting.refresh_from_db()
    sent.refresh_from_db()
    assert (waiting.state, waiting.cancel_reason) == (State.CANCELLED, "scenario changed")
    assert sent.state == State.SENT
    assert single.outbound_message_send(waiting.pk).status == "not-waiting"
    assert sandbox.calls(token=bot.token, chat_id=1) == []


@pytest.mark.django_db
def test_the_relevance_check_vetoes_a_send_and_the_reason_is_kept(bot, sandbox, settings) -> None:
    settings.DOVECOTE_RELEVANCE_CHECK = "tests.outbox.test_delivery_rules.veto_stale"
    reminder = enqueue(bot, chat_id=1, text="Pay your order #7")
    greeting = enqueue(bot, chat_id=2, text="Hello")

    result, reminder = drive(reminder.pk)
    _, greeting = drive(greeting.pk)

    assert result.status == "vetoed"
    assert reminder.state == State.CANCELLED
    assert reminder.cancel_reason == "not relevant: the order was already paid"
    assert greeting.state == State.SENT
    assert sandbox.sent_texts(token=bot.token) == ["Hello"]


# --- order within a chat -------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_later_message_never_overtakes_an_earlier_one_that_is_retrying(bot, sandbox) -> None:
    sandbox.fault("5xx", count=1, token=bot.token)
    answer = enqueue(bot, chat_id=5, text="the answer")
    follow_up = enqueue(bot, chat_id=5, text="the follow-up")

    assert single.outbound_message_send(answer.pk).status == "retry"
    assert single.outbound_message_send(follow_up.pk).status == "waiting-for-earlier"
    drive(answer.pk)
    drive(follow_up.pk)

    assert sandbox.sent_texts(token=bot.token, chat_id=5) == ["the answer", "the follow-up"]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_an_unordered_message_does_not_wait_for_the_chat(bot, sandbox) -> None:
    sandbox.fault("5xx", count=1, token=bot.token)
    answer = enqueue(bot, chat_id=5, text="the answer")
    notice = enqueue(bot, chat_id=5, text="independent notice", ordered=False)

    assert single.outbound_message_send(answer.pk).status == "retry"
    assert single.outbound_message_send(notice.pk).status == "sent"
    drive(answer.pk)

    assert sandbox.sent_texts(token=bot.token, chat_id=5) == ["independent notice", "the answer"]


def enqueue_call(bot, chat_id: int, method: str, payload: dict, **options) -> OutboundMessage:
    """A Bot API call that is not a message, with a key of its own."""
    message, _ = services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=chat_id, method=method, payload=payload, idempotency_key=f"{method}:{chat_id}", **options
    )
    return message


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_callback_answer_does_not_wait_behind_a_retrying_message_of_its_chat(bot, sandbox) -> None:
    # Telegram allows a few seconds to answer a button press; a reply stuck in retry must
    # not make the button spin until it fails.
    sandbox.fault("5xx", count=1, token=bot.token)
    answer = enqueue(bot, chat_id=5, text="the answer")
    ack = enqueue_call(bot, 5, "answerCallbackQuery", {"callback_query_id": "cb-1"})

    assert single.outbound_message_send(answer.pk).status == "retry"
    assert ack.ordered is False
    assert single.outbound_message_send(ack.pk).status == "sent"
    drive(answer.pk)

    assert [c["method"] for c in sandbox.calls(token=bot.token)] == [
        "sendMessage",
        "answerCallbackQuery",
        "sendMessage",
    ]


@pytest.mark.django_db
def test_a_typing_indicator_takes_no_slot_of_the_chats_message_limit(bot, sandbox) -> None:
    # One message a second in a private chat: if the typing indicator took that slot, the
    # reply it announces would wait a second behind it.
    typing = enqueue_call(bot, 9, "sendChatAction", {"action": "typing"})
    reply = enqueue(bot, chat_id=9, text="the reply")
    assert single.outbound_message_send(typing.pk).status == "sent"
    assert single.outbound_message_send(reply.pk).status == "sent"

    # A message does take it: a second one in the same second waits.
    second = enqueue(bot, chat_id=9, text="one more")
    assert single.outbound_message_send(second.pk).status == "rate-limited"


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_caller_may_still_order_a_call_that_is_not_a_message(bot) -> None:
    typing = enqueue_call(bot, 9, "sendChatAction", {"action": "typing"}, ordered=True)
    assert typing.ordered is True
    assert enqueue(bot, chat_id=9, text="a message").ordered is True


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
@pytest.mark.parametrize(("fault", "state"), [("403", State.FAILED), ("drop_after_deliver", State.UNKNOWN)])
def test_a_dead_lettered_or_unknown_earlier_message_does_not_block_the_chat(bot, sandbox, fault, state) -> None:
    sandbox.fault(fault, count=1, token=bot.token)
    doomed = enqueue(bot, chat_id=9, text="first")
    later = enqueue(bot, chat_id=9, text="second")

    _, doomed = drive(doomed.pk)
    _, later = drive(later.pk)

    assert doomed.state == state
    assert later.state == State.SENT


# --- races and the shared limiter (real threads, each with its own DB connection) ---------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("no_limits")
def test_two_workers_racing_for_one_message_send_it_once(bot, sandbox) -> None:
    messages = [enqueue(bot, chat_id=100 + i, text=f"race {i}") for i in range(10)]

    def worker(i: int) -> list[str]:
        return [single.outbound_message_send(m.pk).status for m in messages]

    statuses = in_threads(2, worker)

    sent = [s for worker_statuses in statuses for s in worker_statuses if s == "sent"]
    assert len(sent) == 10
    assert len(sandbox.calls(token=bot.token)) == 10
    assert all(m.attempts == 1 for m in OutboundMessage.objects.filter(bot=bot))


def warm_up(bot) -> None:
    """Open the bot's HTTP connection first, so that its set-up does not skew arrival times."""
    assert botapi.call(token=bot.token, base_url=bot.api_base_url, method="getMe", params={}).ok


def _max_in_window(times: list[float], span: float) -> int:
    times = sorted(times)
    return max(sum(1 for t in times[i:] if t - start < span) for i, start in enumerate(times))


@pytest.mark.django_db(transaction=True)
def test_the_per_bot_limit_is_shared_by_concurrent_workers(bot_factory, sandbox) -> None:
    bot = bot_factory(rate_limit=5)
    warm_up(bot)
    messages = [enqueue(bot, chat_id=300 + i, text=f"n{i}", ordered=False) for i in range(12)]

    in_threads(2, lambda i: [drive(m.pk)[1].state for m in messages[i::2]])

    assert OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 12
    calls = sandbox.calls(token=bot.token, method="sendMessage")
    assert len(calls) == 12
    assert _max_in_window([c["at"] for c in calls], 1.0) <= 5


@pytest.mark.django_db(transaction=True)
def test_requests_arriving_late_and_unevenly_still_keep_within_the_bots_limit(bot_factory, sandbox) -> None:
    # Telegram counts a request when it arrives. Let go at the bot's pace but arriving up
    # to 400 ms late, each a different time, requests counted when they left put six into
    # one of Telegram's seconds, or two into a chat's: a 429 that holds the whole bot.
    bot = bot_factory(rate_limit=5)
    warm_up(bot)
    sandbox.limits(per_bot_per_second=5, per_private_chat_per_second=1, arrival_jitter_ms=400)
    messages = [enqueue(bot, chat_id=400 + i % 4, text=f"n{i}", ordered=False) for i in range(16)]

    in_threads(4, lambda i: [drive(m.pk, timeout=30)[1].state for m in messages[i::4]])

    calls = sandbox.calls(token=bot.token, method="sendMessage")
    assert [c["status"] for c in calls] == [200] * 16
    assert OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 16


@pytest.mark.django_db
def test_a_send_counts_in_the_bots_window_until_a_second_after_its_answer(bot) -> None:
    sends = [ratelimit.acquire(bot_id=bot.pk, bot_rate=2, chat_id=None, slot_reserved=True) for _ in range(2)]
    assert [w.seconds for w in sends] == [0, 0]
    # Both still on the way, however long they take (a worker that died with one in
    # flight leaves it there for the longest wait of a caller): a third waits.
    third = ratelimit.acquire(bot_id=bot.pk, bot_rate=2, chat_id=None, slot_reserved=True)
    assert third.seconds > 30
    assert third.entry is None

    ratelimit.leave([sends[0].entry])

    assert 0.9 < ratelimit.acquire(bot_id=bot.pk, bot_rate=2, chat_id=None, slot_reserved=True).seconds <= 1.0
    ratelimit.leave([sends[1].entry], sent=False)  # it never went: its place is free at once
    assert ratelimit.acquire(bot_id=bot.pk, bot_rate=2, chat_id=None, slot_reserved=True).seconds == 0


@pytest.mark.django_db(transaction=True)
def test_the_per_chat_limit_is_shared_by_concurrent_workers(bot_factory, sandbox) -> None:
    bot = bot_factory(rate_limit=30)
    warm_up(bot)
    messages = [enqueue(bot, chat_id=777, text=f"n{i}", ordered=False) for i in range(3)]

    in_threads(3, lambda i: drive(messages[i].pk)[1].state)

    calls = sorted(c["at"] for c in sandbox.calls(token=bot.token, method="sendMessage"))
    assert len(calls) == 3
    assert _max_in_window(calls, 1.0) == 1


@pytest.mark.django_db
def test_a_private_chats_next_message_waits_a_second_from_the_answer_to_the_one_before(bot) -> None:
    # Telegram counts a request when it arrives, somewhere between its send and its answer:
    # a second from the send could be less than a second from its arrival, and a 429
    # pauses the whole bot.
    first = ratelimit.acquire(bot_id=bot.pk, bot_rate=30, chat_id=31)
    assert first.seconds == 0
    assert ratelimit.acquire(bot_id=bot.pk, bot_rate=30, chat_id=31).seconds > 0  # still on the way
    time.sleep(0.3)

    ratelimit.leave([first.entry])

    assert 0.9 < ratelimit.chat_wait(bot_id=bot.pk, chat_id=31) <= 1.0
    assert ratelimit.chat_wait(bot_id=bot.pk, chat_id=32) == 0  # another chat is free


@pytest.mark.django_db
def test_a_batchs_chats_are_looked_up_together_each_with_its_own_wait(bot) -> None:
    # The drain asks for a whole batch's chats at once (one Redis round trip for the gates).
    busy = ratelimit.acquire(bot_id=bot.pk, bot_rate=30, chat_id=41)
    ratelimit.leave([busy.entry])

    waits = ratelimit.chat_waits(bot_id=bot.pk, chat_ids=[41, 43, None, -42])

    assert 0.9 < waits[0] <= 1.0  # a private chat answered just now: its gate is held
    assert waits[1:] == [0.0, 0.0, 0.0]  # another chat, no chat at all, a group (its own window)
    assert waits[0] == pytest.approx(ratelimit.chat_wait(bot_id=bot.pk, chat_id=41), abs=0.05)


@pytest.mark.django_db(transaction=True)
def test_a_reply_committed_while_its_heads_sent_mark_runs_is_handed_on_not_left_for_the_sweeper(bot) -> None:
    # Found by bench/sidebyside.py: under a burst a few replies stayed pending until the
    # sweeper. The head's "sent" statement did not see the reply (committed during it), and
    # the reply's own send, just before that statement committed, still saw the head in
    # flight: each left the reply to the other.
    import threading

    from django.db import connection, transaction

    from outbox import transitions

    head = enqueue(bot, chat_id=77, text="the answer")
    [claimed] = transitions.claim_batch(bot_id=bot.pk, worker="w1", lease=timedelta(minutes=1), limit=1)
    attempt = transitions.begin_attempts([claimed], worker="w1")[head.pk]
    locked, go_on = threading.Event(), threading.Event()

    def hold_the_heads_row() -> None:
        # The "sent" statement then takes its snapshot and waits on the row.
        try:
            with transaction.atomic():
                OutboundMessage.objects.select_for_update().get(pk=head.pk)
                locked.set()
                go_on.wait(10)
        finally:
            connection.close()

    done: dict = {}

    def mark_the_head_sent() -> None:
        try:
            ok = botapi.CallOutcome(ok=True, result={"message_id": 9}, http_status=200)
            done.update(transitions.mark_sent([(claimed, attempt, ok)], worker="w1", next_in_chat=True))
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_heads_row)
    holder.start()
    assert locked.wait(10)
    marker = threading.Thread(target=mark_the_head_sent)
    marker.start()
    wait_until_a_statement_waits_for_a_row_lock()  # the "sent" statement, snapshot taken
    reply = enqueue(bot, chat_id=77, text="the follow-up")
    # The reply's own send now: its head is still in flight, so it is not claimed.
    lease = timedelta(minutes=1)
    assert transitions.claim_batch(bot_id=bot.pk, worker="w2", lease=lease, limit=5, ids=[reply.pk]) == []
    go_on.set()
    holder.join(10)
    marker.join(10)

    assert OutboundMessage.objects.get(pk=head.pk).state == State.SENT
    assert done == {head.pk: reply.pk}  # handed on to the bot's drain by the caller


def wait_until_a_statement_waits_for_a_row_lock(timeout: float = 10.0) -> None:
    from django.db import connection

    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.02)
    raise AssertionError("no statement came to wait for the locked row")
