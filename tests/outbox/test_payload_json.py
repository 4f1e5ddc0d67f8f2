"""A payload is JSON, whichever way a message is written: the hot path's rows (core/rows.py:
one INSERT, or orjson's batch, written claimed or not) and the ORM's (a split text, a
broadcast) refuse the same values with the same MessageRejected, and store the rest alike.
Found from outside: a datetime went in as text through the batch and was a TypeError on the
single path; a NUL or half a surrogate pair was a DataError (a 500 through the API)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from outbox import dispatch, services
from outbox.models import OutboundMessage

pytestmark = pytest.mark.django_db


def single(bot: Any, payload: dict) -> None:
    services.outbound_message_enqueue(bot_id=bot.pk, chat_id=1, payload=payload, idempotency_key="k")


def written_claimed(bot: Any, payload: dict) -> None:
    # A worker that sends what it writes: the row goes in claimed, through orjson.
    with dispatch.holding():
        single(bot, payload)


def batch(bot: Any, payload: dict) -> None:
    services.outbound_messages_enqueue(
        [{"bot_id": bot.pk, "chat_id": 1, "payload": payload, "idempotency_key": f"k{n}"} for n in (1, 2)]
    )


def split_text(bot: Any, payload: dict) -> None:
    # Too long for one message: its parts are written through the ORM.
    single(bot, {**payload, "text": "word " * 1000})


def broadcast(bot: Any, payload: dict) -> None:
    services.broadcast_enqueue(bot_id=bot.pk, chat_ids=[1, 2], payload=payload, broadcast_key="b")


PATHS: dict[str, Callable[[Any, dict], None]] = {
    "single": single,
    "written_claimed": written_claimed,
    "batch": batch,
    "split_text": split_text,
    "broadcast": broadcast,
}

NOT_JSON = {
    "datetime": dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
    "naive datetime": dt.datetime(2030, 1, 1),  # noqa: DTZ001 - the value under test
    "date": dt.date(2030, 1, 1),
    "Decimal": Decimal("1.50"),
    "set": {1, 2},
    "bytes": b"\x01\x02",
    "keys of two types": {1: "a", "b": 2},
    "NaN": float("nan"),
    "NUL in a string": "a\x00b",
    "NUL in a key": {"a\x00": 1},
    "half a surrogate pair": "\ud83d",
    "the other half": "x\ude00",
    "both halves as two characters": "\ud83d\ude00",  # not Unicode text, whatever it looks like
}


def refusal(path: Callable[[Any, dict], None], bot: Any, value: Any) -> str:
    with pytest.raises(services.MessageRejected) as refused:
        path(bot, {"text": "hello", "extra": {"nested": [value]}})
    assert refused.value.field == "payload"
    assert not OutboundMessage.objects.exists()
    return str(refused.value)


@override_settings(DOVECOTE_INLINE_WORK=False)
@pytest.mark.parametrize("kind", list(NOT_JSON))
def test_every_path_refuses_what_json_cannot_hold_with_the_same_error(bot, kind) -> None:
    errors = {name: refusal(path, bot, NOT_JSON[kind]) for name, path in PATHS.items()}

    assert len(set(errors.values())) == 1, errors
    assert "payload" in errors["single"]


@override_settings(DOVECOTE_INLINE_WORK=False)
@pytest.mark.parametrize("name", list(PATHS))
def test_every_path_stores_what_json_can_hold_alike(bot, name) -> None:
    payload = {
        "text": "hello 🐦 \\u0000 \\ud83d, not escapes",
        "tuple": (1, "a"),
        "int keys": {1: "one"},
        "big": 2**70,
        "deep": [[[{"a": None, "b": True, "c": -1.5}]]],
    }

    PATHS[name](bot, payload)

    first = OutboundMessage.objects.order_by("pk").first()
    assert first.state == ("sending" if name == "written_claimed" else "pending")
    stored = first.payload
    assert stored["tuple"] == [1, "a"]
    assert stored["int keys"] == {"1": "one"}
    assert stored["big"] == 2**70
    assert stored["deep"] == [[[{"a": None, "b": True, "c": -1.5}]]]
    if name != "split_text":
        assert stored["text"] == "hello 🐦 \\u0000 \\ud83d, not escapes"


def test_the_orm_itself_refuses_a_datetime_and_stores_a_tuple_as_a_list(bot) -> None:
    # What the services refuse up front, the model's own JSONField refuses too (Django's error).
    now = timezone.now()
    with pytest.raises(TypeError, match="not JSON serializable"), transaction.atomic():
        OutboundMessage.objects.create(
            bot=bot, chat_id=1, payload={"at": now}, idempotency_key="orm-1", next_attempt_at=now
        )
    row = OutboundMessage.objects.create(
        bot=bot, chat_id=1, payload={"pair": (1, 2)}, idempotency_key="orm-2", next_attempt_at=now
    )
    row.refresh_from_db()
    assert row.payload == {"pair": [1, 2]}
