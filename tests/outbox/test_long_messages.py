"""Texts longer than Telegram allows: a sendMessage is split into ordered outbox messages, a
caption or an edit is refused clearly, and Telegram's own 400 "message is too long" is a
dead letter at once. Real PostgreSQL, the sandbox over HTTP, the REST API in-process."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction
from django.utils import timezone
from rest_framework.test import APIClient

from outbox import services
from outbox.models import DeadLetter, ErrorClass, OutboundMessage, State
from outbox.sending import batch, single
from outbox.splitting import utf16_len
from tests.outbox.helpers import drive

pytestmark = pytest.mark.django_db

PARAGRAPH = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40  # 2,280 characters
LONG = (PARAGRAPH.strip() + "\n\n") * 3 + "The end."  # ~6,900: two cuts, at paragraph breaks
BUTTONS = {"inline_keyboard": [[{"text": "Thanks", "callback_data": "thanks"}]]}


@pytest.fixture
def no_limits(settings) -> None:
    settings.DOVECOTE_RATE_LIMITS_ENABLED = False


def enqueue_long(bot, *, key: str = "answer-1", text: str = LONG, **payload):
    return services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=4242, payload={"text": text, **payload}, idempotency_key=key
    )


def parts_of(bot) -> list[OutboundMessage]:
    return list(OutboundMessage.objects.filter(bot=bot).order_by("pk"))


# --- enqueue -----------------------------------------------------------------------------------


def test_a_long_text_becomes_ordered_messages_and_the_first_keeps_the_key(bot) -> None:
    message, created = services.outbound_message_enqueue(
        bot_id=bot.pk,
        chat_id=4242,
        payload={
            "text": LONG,
            "reply_parameters": {"message_id": 7},
            "reply_markup": BUTTONS,
            "disable_notification": True,
        },
        idempotency_key="answer-1",
        ordered=False,  # the parts of one text go in order all the same
    )

    rows = parts_of(bot)
    assert created
    assert message.pk == rows[0].pk
    assert [m.idempotency_key for m in rows] == ["answer-1", "answer-1#2", "answer-1#3"]
    texts = [m.payload["text"] for m in rows]
    assert "\n\n".join(texts) == LONG
    assert all(utf16_len(t) <= 4096 for t in texts)
    assert [("reply_parameters" in m.payload, "reply_markup" in m.payload) for m in rows] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert all(m.payload["disable_notification"] and m.ordered and m.state == State.PENDING for m in rows)


def test_the_same_key_twice_creates_the_parts_once_and_returns_the_first(bot) -> None:
    first, created_first = enqueue_long(bot)
    again, created_again = enqueue_long(bot)

    assert (created_first, created_again) == (True, False)
    assert again.pk == first.pk
    assert OutboundMessage.objects.filter(bot=bot).count() == 3


@pytest.mark.django_db(transaction=True)
def test_two_workers_enqueueing_the_same_long_text_at_once_write_its_parts_once(bot) -> None:
    start = threading.Barrier(2)
    results: list[bool] = []

    def enqueue() -> None:
        try:
            start.wait()
            results.append(enqueue_long(bot)[1])
        finally:
            connection.close()

    threads = [threading.Thread(target=enqueue) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(results) == [False, True]
    assert [m.idempotency_key for m in parts_of(bot)] == ["answer-1", "answer-1#2", "answer-1#3"]


def test_parts_are_written_in_one_transaction(bot) -> None:
    def enqueue_then_fail() -> None:
        with transaction.atomic():
            enqueue_long(bot)
            raise RuntimeError("the caller's transaction fails after the enqueue")

    with pytest.raises(RuntimeError):
        enqueue_then_fail()

    assert not OutboundMessage.objects.exists()


def test_a_part_key_taken_by_another_message_refuses_the_whole_text(bot) -> None:
    services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=1, payload={"text": "unrelated"}, idempotency_key="answer-1#3"
    )

    with pytest.raises(services.MessageRejected, match="taken"):
        enqueue_long(bot)
    assert OutboundMessage.objects.filter(bot=bot).count() == 1


@pytest.mark.usefixtures("no_limits")
def test_the_parts_arrive_one_after_another_in_order_through_the_drain(bot, sandbox) -> None:
    enqueue_long(bot, reply_markup=BUTTONS)

    sent = 0
    for _ in range(5):
        sent += batch.outbound_messages_drain(bot.pk).sent
    calls = sandbox.calls(token=bot.token, method="sendMessage")

    assert sent == 3
    assert [c["status"] for c in calls] == [200, 200, 200]
    assert "\n\n".join(c["params"]["text"] for c in calls) == LONG
    assert [m.telegram_message_id for m in parts_of(bot)] == sorted(m.telegram_message_id for m in parts_of(bot))
    assert "reply_markup" in calls[-1]["params"]


@pytest.mark.usefixtures("no_limits")
def test_a_later_part_waits_for_the_first_to_be_sent(bot, sandbox) -> None:
    first, _ = enqueue_long(bot)
    second = parts_of(bot)[1]

    assert single.outbound_message_send(second.pk).status == "waiting-for-earlier"
    drive(first.pk)
    _, second = drive(second.pk)
    assert second.state == State.SENT


def test_a_long_html_text_is_split_into_well_formed_parts(bot) -> None:
    text = "<b>" + "bold words " * 600 + "</b>"

    enqueue_long(bot, text=text, parse_mode="HTML")

    rows = parts_of(bot)
    assert len(rows) == 2
    assert all(m.payload["text"].startswith("<b>") and m.payload["text"].endswith("</b>") for m in rows)
    assert all(m.payload["parse_mode"] == "HTML" for m in rows)


def test_a_long_markdown_text_is_refused_with_a_reason(bot) -> None:
    with pytest.raises(services.MessageRejected, match="MarkdownV2 text longer than 4096"):
        enqueue_long(bot, text="*bold* " * 1000, parse_mode="MarkdownV2")
    assert not OutboundMessage.objects.exists()


def test_a_broadcast_of_a_long_text_is_refused_not_split(bot) -> None:
    with pytest.raises(services.MessageRejected, match="4096"):
        services.broadcast_enqueue(bot_id=bot.pk, chat_ids=[1, 2], payload={"text": LONG}, broadcast_key="news")


# --- captions and edits ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "payload"),
    [
        ("sendPhoto", {"photo": "file-1", "caption": "x" * 1025}),
        ("sendDocument", {"document": "file-1", "caption": "😀" * 513}),  # 1,026 UTF-16 units
        ("editMessageCaption", {"message_id": 5, "caption": "x" * 1025}),
        (
            "sendMediaGroup",
            {"media": [{"type": "photo", "media": "f", "caption": "x" * 1025}, {"type": "photo", "media": "g"}]},
        ),
    ],
)
def test_a_caption_over_1024_utf16_units_is_rejected(bot, method, payload) -> None:
    with pytest.raises(services.MessageRejected, match=r"caption is \d+ UTF-16 units long; Telegram allows 1024"):
        services.outbound_message_enqueue(
            bot_id=bot.pk, chat_id=1, method=method, payload=payload, idempotency_key="c1"
        )
    assert not OutboundMessage.objects.exists()


def test_a_caption_measured_after_html_parsing_may_be_longer_in_markup(bot) -> None:
    caption = "<b>" + "x" * 1024 + "</b>"
    _, created = services.outbound_message_enqueue(
        bot_id=bot.pk,
        chat_id=1,
        method="sendPhoto",
        payload={"photo": "file-1", "caption": caption, "parse_mode": "HTML"},
        idempotency_key="c1",
    )
    assert created


def test_an_edit_over_4096_units_is_rejected_because_it_cannot_be_split(bot) -> None:
    with pytest.raises(services.MessageRejected, match="an edit cannot be split"):
        services.outbound_message_enqueue(
            bot_id=bot.pk,
            chat_id=1,
            method="editMessageText",
            payload={"message_id": 5, "text": "x" * 4097},
            idempotency_key="e1",
        )


# --- Telegram's 400 ----------------------------------------------------------------------------


def _stored_too_long(bot) -> OutboundMessage:
    # Written past the enqueue's checks (a row from before this version, a correction made in
    # SQL): Telegram - here the sandbox - is the one to refuse it.
    return OutboundMessage.objects.create(
        bot=bot,
        chat_id=4242,
        method="sendMessage",
        payload={"text": "😀" * 2049},
        idempotency_key="old-1",
        next_attempt_at=timezone.now(),
    )


def test_telegrams_message_is_too_long_dead_letters_after_exactly_one_attempt(bot, sandbox) -> None:
    message = _stored_too_long(bot)

    result, message = drive(message.pk)

    assert result.status == "dead-lettered"
    assert (message.state, message.attempts, message.last_error_class) == (State.FAILED, 1, ErrorClass.PERMANENT)
    attempt = message.attempt_set.get()
    assert (attempt.http_status, attempt.error_code) == (400, 400)
    assert "message is too long" in attempt.description.lower()
    letter = DeadLetter.objects.get(message=message)
    assert letter.reason_class == ErrorClass.PERMANENT
    assert [c["status"] for c in sandbox.calls(token=bot.token)] == [400]


@pytest.mark.usefixtures("no_limits")
def test_a_400_in_a_drain_batch_dead_letters_after_exactly_one_attempt(bot, sandbox) -> None:
    message = _stored_too_long(bot)

    report = batch.outbound_messages_drain(bot.pk)
    batch.outbound_messages_drain(bot.pk)

    message.refresh_from_db()
    assert report.failed == 1
    assert (message.state, message.attempts, message.last_error_class) == (State.FAILED, 1, ErrorClass.PERMANENT)
    assert DeadLetter.objects.get(message=message).reason_class == ErrorClass.PERMANENT
    assert len(sandbox.calls(token=bot.token)) == 1


# --- REST API ----------------------------------------------------------------------------------


@pytest.fixture
def alice(bot) -> APIClient:
    from tests.outbox.helpers import api_client

    return api_client("alice", bot)


def post(client: APIClient, body: dict, key: str = "long-answer-1"):
    return client.post("/api/v1/messages/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_the_api_answers_201_with_the_parts_then_200_for_the_same_key_and_body(alice, bot) -> None:
    body = {"bot": bot.name, "chat_id": 4242, "payload": {"text": LONG}}

    first = post(alice, body)
    again = post(alice, body)

    assert (first.status_code, again.status_code) == (201, 200)
    data = first.json()
    rows = parts_of(bot)
    assert data["id"] == rows[0].pk
    assert data["parts"] == [m.pk for m in rows]
    assert len(rows) == 3
    assert again.json() == data
    assert alice.get(f"/api/v1/messages/{data['id']}/").json()["parts"] == data["parts"]
    assert alice.get(f"/api/v1/messages/{rows[1].pk}/").json()["parts"] == [rows[1].pk]


def test_the_api_lists_a_single_message_as_its_only_part(alice, bot) -> None:
    response = post(alice, {"bot": bot.name, "chat_id": 4242, "payload": {"text": "short"}})

    assert response.status_code == 201
    assert response.json()["parts"] == [response.json()["id"]]


def test_the_api_refuses_a_caption_over_1024_units_with_a_clear_400(alice, bot) -> None:
    body = {"bot": bot.name, "chat_id": 1, "method": "sendPhoto", "payload": {"photo": "f", "caption": "x" * 1025}}

    response = post(alice, body)

    assert response.status_code == 400
    assert "Telegram allows 1024" in response.json()["payload"][0]
    assert not OutboundMessage.objects.exists()


def test_cancelling_a_long_text_cancels_its_waiting_parts_too(bot) -> None:
    """Found by the fault schedules: a cancel took the first part only, and the rest of the
    answer would have gone out on its own."""
    message, _ = services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=4242, payload={"text": LONG}, idempotency_key="answer-cancel"
    )

    assert services.outbound_message_cancel(message.pk, reason="the user left")

    assert [m.state for m in parts_of(bot)] == [State.CANCELLED] * 3
