"""bots 0006 removes the inbox's never-entered `processing` and `failed` states and their
lease columns from the model, on a live table: rows an older version left in those states go
back to `new`, and during the deploy both the old web processes (which still insert the lease
columns) and the new ones (which do not) can store updates."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from bots.inbox import inbox_update_store
from bots.models import InboundUpdate, UpdateState
from tests.bots.test_webhook import message_update

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("bots", "0005_ops_chat")]
AFTER = [("bots", "0006_inbox_without_processing")]


def migrate(targets: list[tuple[str, str]]) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


def insert_as_an_old_web_process(bot_id: int, update_id: int, state: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO bots_inboundupdate (bot_id, update_id, update_type, chat_type, payload, state, attempts,
                 next_attempt_at, lease_owner, lease_expires_at, trace_id, last_error, received_at)
               VALUES (%s, %s, 'message', 'private', %s, %s, 0, now(), '', NULL, 't', '', now())""",
            [bot_id, update_id, json.dumps({"update_id": update_id}), state],
        )


def test_stranded_states_go_back_to_new_and_old_and_new_inserts_both_work_during_the_deploy(bot) -> None:
    try:
        migrate(BEFORE)
        insert_as_an_old_web_process(bot.pk, 1, "processing")
        insert_as_an_old_web_process(bot.pk, 2, "failed")
        migrate(AFTER)

        assert set(InboundUpdate.objects.filter(bot=bot).values_list("state", flat=True)) == {UpdateState.NEW}
        insert_as_an_old_web_process(bot.pk, 3, "new")  # an old process, still serving
        _, created = inbox_update_store(bot=bot, payload=message_update(4, "hi"))  # a new one
        assert created
        assert InboundUpdate.objects.filter(bot=bot).count() == 4
    finally:
        migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
