"""Writers of one chat's ordered messages on two connections: the later writer waits for the
earlier one's transaction, so a chat's messages commit in the order of their ids and a
message written claimed never goes beside an earlier one that was still uncommitted when it
was written. Every write path of an ordered message takes the chat's write lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from django.db import connection, transaction

from outbox import dispatch
from outbox.models import OutboundMessage, State
from outbox.services import outbound_message_enqueue, outbound_messages_enqueue

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = 777
HOLD_SECONDS = 1.0


def _one(bot_id: int, key: str, text: str = "second") -> None:
    outbound_message_enqueue(bot_id=bot_id, chat_id=CHAT, payload={"text": text}, idempotency_key=key)


def _many(bot_id: int, key: str) -> None:
    outbound_messages_enqueue(
        [{"bot_id": bot_id, "chat_id": CHAT, "payload": {"text": "second"}, "idempotency_key": key}]
    )


def _held(write: Callable[[int, str], None]) -> Callable[[int, str], None]:
    """The write as a worker that sends what it writes makes it: written claimed when it may go."""

    def held_write(bot_id: int, key: str) -> None:
        with dispatch.holding():
            write(bot_id, key)

    return held_write


WRITES = {
    "enqueue": _one,
    "enqueue, written claimed": _held(_one),
    "enqueue_many": _many,
    "enqueue_many, written claimed": _held(_many),
    "a text split in parts": lambda bot_id, key: _one(bot_id, key, text="word " * 2000),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_second_writer_of_a_chat_waits_for_the_first_writers_commit_and_does_not_go_beside_it(
    bot, write: Callable[[int, str], None]
) -> None:
    written = threading.Event()
    commit_started_at: list[float] = []

    def first_writer() -> None:
        try:
            with transaction.atomic():
                _one(bot.pk, "first", text="first")
                written.set()
                time.sleep(HOLD_SECONDS)
                commit_started_at.append(time.monotonic())
        finally:
            connection.close()

    thread = threading.Thread(target=first_writer)
    thread.start()
    assert written.wait(10)
    write(bot.pk, "second")
    returned_at = time.monotonic()
    thread.join(10)

    first = OutboundMessage.objects.get(bot=bot, idempotency_key="first")
    second = OutboundMessage.objects.get(bot=bot, idempotency_key="second")
    assert returned_at >= commit_started_at[0]  # it waited for the first writer's commit
    assert second.pk > first.pk
    # The first message is open (due, not sent): the second may not be claimed beside it.
    assert first.state == State.PENDING
    assert second.state == State.PENDING


def test_writers_of_different_chats_do_not_wait_for_each_other(bot) -> None:
    written = threading.Event()

    def first_writer() -> None:
        try:
            with transaction.atomic():
                outbound_message_enqueue(bot_id=bot.pk, chat_id=1, payload={"text": "a"}, idempotency_key="a")
                written.set()
                time.sleep(HOLD_SECONDS * 3)
        finally:
            connection.close()

    thread = threading.Thread(target=first_writer)
    thread.start()
    assert written.wait(10)
    started = time.monotonic()
    outbound_message_enqueue(bot_id=bot.pk, chat_id=2, payload={"text": "b"}, idempotency_key="b")
    took = time.monotonic() - started
    thread.join(10)
    assert took < HOLD_SECONDS * 3  # it did not wait out the other chat's transaction
