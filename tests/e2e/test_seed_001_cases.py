"""Seed 001's test list, the cases that need real processes (Celery workers, gunicorn, the
sandbox over HTTP): two parallel workers on one backlog, a response lost after the action
happened, and a key that must not be too wide for a new legitimate request.

The rest of its list lives where it fits: replay of a finished update
(tests/bots/test_consumers.py, tests/e2e/test_echo.py: test_replay_of_a_finished_update_...),
replay of a finished API request (tests/outbox/test_api.py), the same button pressed again
(tests/bots/test_consumers.py: test_a_key_per_press_...), restarts between storing and
finishing (tests/e2e/test_restart_points.py), transient / schema / auth failures
(tests/bots/test_consumers.py, tests/outbox/test_error_classes.py).
"""

from __future__ import annotations

import time

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import transaction
from django.test import override_settings

from outbox.dispatch import dispatch
from outbox.models import OutboundMessage, State
from outbox.sending.single import outbound_message_send
from outbox.services import outbound_message_enqueue
from reconciliation import services as reconciliation_services
from reconciliation.models import AuditEntry, CaseStatus, Decision, ReconciliationCase
from reconciliation.sweeper import sweep
from tests.support import Process, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

NO_WAIT = {"DOVECOTE_REDISPATCH_GRACE_SECONDS": 0, "DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS": 0}


def test_two_parallel_workers_on_one_backlog_send_each_message_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    workers = []
    for name in ("worker-a", "worker-b"):
        workers.append(start_worker(process_env, pool="solo", concurrency=1, name=name))
        processes.append(workers[-1])
    bot = bot_factory(rate_limit=100)
    chats = range(6000, 6030)
    with transaction.atomic():
        messages = [
            outbound_message_enqueue(
                bot_id=bot.pk, chat_id=chat, payload={"text": f"backlog {chat}"}, idempotency_key=f"backlog-{chat}"
            )[0]
            for chat in chats
        ]
    # Beside the bot's drains, every message is also handed to both workers twice, as
    # redelivered broker messages would be: the two processes race on every row.
    for message in messages:
        for _ in range(2):
            assert dispatch(message.pk)

    rows = OutboundMessage.objects.filter(bot=bot)
    wait_until(lambda: rows.filter(state=State.SENT).count() == len(chats), timeout=60, message="the backlog sent")
    time.sleep(1.0)  # room for a duplicate to show up

    assert {(m.state, m.attempts) for m in rows} == {(State.SENT, 1)}
    assert all(m.attempt_set.count() == 1 for m in rows)
    calls = sandbox.calls(token=bot.token, method="sendMessage")
    assert sorted(c["params"]["chat_id"] for c in calls) == list(chats)
    for worker in workers:
        log = worker.log()
        assert "outbox.send_outbound_message[" in log or "outbox.drain_bot[" in log, f"{worker.name} took no part"


def test_a_response_lost_after_the_message_was_delivered_is_unknown_not_resent_and_an_operator_settles_it(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    processes.append(start_worker(process_env, pool="solo", concurrency=1, name="worker-lost"))
    bot = bot_factory()
    sandbox.fault("drop_after_deliver", count=1, token=bot.token)
    message, _ = outbound_message_enqueue(
        bot_id=bot.pk, chat_id=4242, payload={"text": "Your refund is on its way"}, idempotency_key="refund-1"
    )
    wait_until(lambda: OutboundMessage.objects.filter(pk=message.pk, state=State.UNKNOWN).exists(), timeout=30)

    # Telegram has the message; its answer never came back: held, with a case.
    delivered = sandbox.messages(token=bot.token)
    assert len(delivered) == 1
    case = ReconciliationCase.objects.get(message=message)
    assert (case.status, case.idempotency_key) == (CaseStatus.OPEN, "refund-1")
    with override_settings(**NO_WAIT):
        sweep()
        sweep()
    assert outbound_message_send(message.pk).status == "not-waiting"
    time.sleep(0.5)
    assert len(sandbox.calls(token=bot.token, method="sendMessage")) == 1
    message.refresh_from_db()
    assert (message.state, message.attempts, message.idempotency_key) == (State.UNKNOWN, 1, "refund-1")

    # The operator finds it in the chat and says so: sent, with Telegram's id, once.
    alice = get_user_model().objects.create_user("alice", is_staff=True)
    telegram_id = delivered[0]["message_id"]
    reconciliation_services.case_mark_delivered(case, alice, "seen in the chat", telegram_message_id=telegram_id)
    message.refresh_from_db()
    assert (message.state, message.telegram_message_id, message.attempts) == (State.SENT, telegram_id, 1)
    case.refresh_from_db()
    assert (case.status, case.decision, case.decided_by) == (CaseStatus.RESOLVED, Decision.MARK_DELIVERED, alice)
    assert AuditEntry.objects.filter(action="reconciliation.mark_delivered", actor=alice).count() == 1
    assert sandbox.sent_texts(token=bot.token) == ["Your refund is on its way"]


def test_a_key_per_update_not_per_chat_and_text_the_same_words_written_again_later_get_a_new_answer(
    web: str, worker, sandbox, bot_factory
) -> None:
    bot = bot_factory()
    call_command("set_webhook", bot.name, "--url", web)
    replies = OutboundMessage.objects.filter(bot=bot, chat_id=777)

    assert sandbox.push_message(bot.token, chat_id=777, text="Is table 4 free?")["webhook_status"] == 200
    wait_until(lambda: replies.filter(state=State.SENT).count() == 1, timeout=30, message="the first answer")
    # Later the same person asks the same thing again: a new message, a new command.
    assert sandbox.push_message(bot.token, chat_id=777, text="Is table 4 free?")["webhook_status"] == 200
    wait_until(lambda: replies.filter(state=State.SENT).count() == 2, timeout=30, message="the second answer")

    assert sandbox.sent_texts(token=bot.token, chat_id=777) == ["Echo: Is table 4 free?"] * 2
    keys = sorted(replies.values_list("idempotency_key", flat=True))
    assert len(set(keys)) == 2
    assert all(key.startswith("upd:") and key.endswith(":auto_reply:0") for key in keys)
