"""Telegram said 200, then the database blinked: the outcome write is retried, so the
message ends `sent` rather than left for the sweeper to call `unknown`."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from outbox.models import OutboundMessage, State
from outbox.sending.single import outbound_message_send
from outbox.services import outbound_message_enqueue
from tests.support import wait_until


def _drop_other_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_database_blip_right_after_telegrams_answer_is_retried_and_the_message_is_sent(bot, sandbox) -> None:
    message, _ = outbound_message_enqueue(
        bot_id=bot.pk, chat_id=77, payload={"text": "receipt #5"}, idempotency_key="receipt-5"
    )
    sandbox.fault("slow", method="sendMessage", delay=1.0, count=1)
    results = []

    def worker() -> None:
        try:
            results.append(outbound_message_send(message.pk).status)
        finally:
            connection.close()

    thread = threading.Thread(target=worker)
    thread.start()
    # The request is out (its attempt row committed on the worker's connection): the
    # database drops that connection while Telegram is answering.
    wait_until(lambda: sandbox.calls(token=bot.token, method="sendMessage"), message="the request")
    assert _drop_other_connections() == 1
    thread.join(15)

    assert results == ["sent"]
    message.refresh_from_db()
    assert (message.state, message.attempts) == (State.SENT, 1)
    assert [a.outcome for a in message.attempt_set.all()] == ["ok"]
    assert sandbox.sent_texts(token=bot.token) == ["receipt #5"]
    assert not OutboundMessage.objects.filter(state=State.SENDING).exists()
