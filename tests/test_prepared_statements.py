"""The hot paths' fixed statements (core/rows.py: fetch, execute, the inserts) are prepared
once per connection on a direct connection, and never behind a transaction pooler."""

from __future__ import annotations

import pytest
from django.db import connection

from outbox.sending import single
from tests.outbox.helpers import enqueue

pytestmark = pytest.mark.django_db


def _prepared(fragment: str) -> list[tuple[int, int]]:
    """(generic plans, custom plans) of this connection's prepared statements containing `fragment`."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            [f"%{fragment}%"],
        )
        return cursor.fetchall()


@pytest.fixture(autouse=True)
def _none_prepared_yet() -> None:
    # The test database's connection outlives a test; psycopg forgets its own record too.
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")


def test_the_attempt_and_sent_statements_are_prepared_once_and_reused(bot, sandbox, settings) -> None:
    settings.DOVECOTE_RATE_LIMITS_ENABLED = False  # three sends in a row, whatever the bot's limit
    messages = [enqueue(bot, chat_id=7000 + i, text=f"prepared {i}") for i in range(3)]

    results = [single.outbound_message_send(m.pk).status for m in messages]

    assert results == ["sent", "sent", "sent"]
    assert sorted(sandbox.sent_texts(token=bot.token)) == ["prepared 0", "prepared 1", "prepared 2"]
    # One prepared statement each, run once per message: planned at most once per run, not
    # sent as new text each time.
    for fragment in ("INSERT INTO outbox_attempt", "SET state = 'sent'"):
        (plans,) = _prepared(fragment)
        assert sum(plans) == 3, fragment


def test_with_the_poolers_setting_nothing_is_prepared(bot, sandbox) -> None:
    # What DATABASE_POOLER=transaction sets (project/settings.py): no prepare threshold.
    connection.connection.prepare_threshold = None
    try:
        message = enqueue(bot, text="unprepared")
        assert single.outbound_message_send(message.pk).status == "sent"
        assert _prepared("INSERT INTO outbox_attempt") == []
    finally:
        connection.connection.prepare_threshold = connection.settings_dict["OPTIONS"]["prepare_threshold"]
