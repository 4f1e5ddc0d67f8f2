"""Several messages written to the outbox at once (outbound_messages_enqueue, a batch
consumer's replies): one statement, ids in the list's order, the single enqueue's rules for
each message. Real PostgreSQL."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from outbox import splitting
from outbox.models import OutboundMessage
from outbox.services import MessageRejected, outbound_message_enqueue, outbound_messages_enqueue

pytestmark = pytest.mark.django_db


def call(bot, key: str, text: str, chat_id: int = 42) -> dict:
    return {"bot_id": bot.pk, "chat_id": chat_id, "payload": {"text": text}, "idempotency_key": key}


def test_new_messages_are_one_insert_with_ids_in_order(bot) -> None:
    with CaptureQueriesContext(connection) as statements:
        enqueued = outbound_messages_enqueue([call(bot, f"k{n}", f"t{n}") for n in range(5)])

    assert len(statements) == 1
    assert [(e.created, e.conflict) for e in enqueued] == [(True, False)] * 5
    stored = list(OutboundMessage.objects.filter(bot=bot).order_by("pk").values_list("idempotency_key", "state"))
    assert stored == [(f"k{n}", "pending") for n in range(5)]
    assert [e.message.pk for e in enqueued] == sorted(e.message.pk for e in enqueued)


def test_a_taken_key_gives_back_its_message_and_says_whether_the_call_differed(bot) -> None:
    same, _ = outbound_message_enqueue(**call(bot, "same", "hello"))
    other, _ = outbound_message_enqueue(**call(bot, "other", "first text"))

    enqueued = outbound_messages_enqueue(
        [call(bot, "same", "hello"), call(bot, "new", "fresh"), call(bot, "other", "second text")]
    )

    assert [(e.message.pk, e.created, e.conflict) for e in enqueued[::2]] == [
        (same.pk, False, False),
        (other.pk, False, True),
    ]
    assert (enqueued[1].created, enqueued[1].conflict) == (True, False)
    assert OutboundMessage.objects.get(pk=other.pk).payload == {"text": "first text"}  # the first stands
    assert OutboundMessage.objects.filter(bot=bot).count() == 3


def test_a_refused_call_writes_none_of_them(bot) -> None:
    with pytest.raises(MessageRejected):
        outbound_messages_enqueue([call(bot, "fine", "ok"), {**call(bot, "bad", "x"), "method": "sendTelepathy"}])

    assert not OutboundMessage.objects.filter(bot=bot).exists()


@pytest.mark.parametrize("number", [float("nan"), float("inf"), -float("inf")])
def test_a_payload_holding_a_number_json_has_no_form_for_is_refused(bot, number: float) -> None:
    location = {"latitude": number, "longitude": 13.4}

    with pytest.raises(MessageRejected, match="payload: Out of range float"):
        outbound_messages_enqueue([{**call(bot, "where", ""), "method": "sendLocation", "payload": location}])
    with pytest.raises(MessageRejected, match="payload: Out of range float"):
        outbound_message_enqueue(bot_id=bot.pk, chat_id=1, method="sendLocation", payload=location, idempotency_key="w")

    assert not OutboundMessage.objects.filter(bot=bot).exists()


def test_a_text_to_split_keeps_its_parts_in_the_lists_order(bot) -> None:
    long_text = "word " * 1000  # ~5,000 characters: two parts

    enqueued = outbound_messages_enqueue(
        [call(bot, "before", "one"), call(bot, "long", long_text), call(bot, "after", "three")]
    )

    assert [e.message.idempotency_key for e in enqueued] == ["before", "long", "after"]
    keys = list(OutboundMessage.objects.filter(bot=bot).order_by("pk").values_list("idempotency_key", flat=True))
    assert keys == ["before", "long", splitting.part_key("long", 2), "after"]  # the second part between them
