"""One update end to end with real processes: sandbox -> webhook (gunicorn) -> inbox ->
consumer run (Celery worker) -> outbox -> python-telegram-bot -> sandbox."""

from __future__ import annotations

import pytest
from django.core.management import call_command

from bots.models import ConsumerRun, InboundUpdate, RunState, UpdateState
from outbox.models import OutboundMessage, State
from tests.support import wait_until

pytestmark = [pytest.mark.e2e]


@pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
def test_each_update_gets_exactly_one_echo_reply(broker: str, web: str, worker, sandbox, bot_factory) -> None:
    bot = bot_factory(webhook_secret="alices-secret")
    call_command("set_webhook", bot.name, "--url", web)

    pushed = [sandbox.push_message(bot.token, chat_id=1000 + i, text=f"hello {i}") for i in range(3)]
    assert [p["webhook_status"] for p in pushed] == [200, 200, 200]

    def all_sent() -> bool:
        return OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 3

    wait_until(all_sent, timeout=30, message="three replies sent")
    for i in range(3):
        chat_id = 1000 + i
        assert sandbox.sent_texts(token=bot.token, chat_id=chat_id) == [f"Echo: hello {i}"]
        message = OutboundMessage.objects.get(bot=bot, chat_id=chat_id)
        received = sandbox.messages(token=bot.token, chat_id=chat_id)
        assert message.telegram_message_id == received[0]["message_id"]
        assert message.attempts == 1
        assert message.attempt_set.get().outcome == "ok"
        update = InboundUpdate.objects.get(bot=bot, chat_id=chat_id)
        assert update.state == UpdateState.DONE
        assert message.trace_id == update.trace_id
        assert message.idempotency_key == f"upd:{update.update_id}:auto_reply:0"
        assert ConsumerRun.objects.get(update=update, consumer="auto_reply").state == RunState.DONE


def test_replay_of_a_finished_update_redelivered_by_telegram_gets_no_second_reply(
    web: str, worker, sandbox, bot_factory
) -> None:
    bot = bot_factory()
    call_command("set_webhook", bot.name, "--url", web)
    first = sandbox.push_message(bot.token, chat_id=555, text="only once")
    update = first["update"]
    wait_until(lambda: OutboundMessage.objects.filter(bot=bot, state=State.SENT).exists(), timeout=30)

    # Telegram redelivers the same update (it got no 200 in time, say).
    again = sandbox.push_update(bot.token, update)
    assert again["webhook_status"] == 200

    # Give a wrongly dispatched duplicate every chance to show up before counting.
    sandbox.wait_for_calls(1, token=bot.token, method="sendMessage")
    import time

    time.sleep(1.5)
    assert sandbox.sent_texts(token=bot.token) == ["Echo: only once"]
    assert InboundUpdate.objects.filter(bot=bot).count() == 1
    assert OutboundMessage.objects.filter(bot=bot).count() == 1


def test_an_update_stored_while_redis_was_down_is_answered_after_the_sweep(
    process_env: dict, processes: list, worker, sandbox, bot_factory
) -> None:
    from reconciliation.sweeper import redispatch_grace, sweep
    from tests.support import start_web

    bot = bot_factory()
    proc, url = start_web({**process_env, "REDIS_URL": "redis://127.0.0.1:9/0"}, name="web-noredis")
    processes.append(proc)
    call_command("set_webhook", bot.name, "--url", url)
    pushed = sandbox.push_message(bot.token, chat_id=31337, text="are you there?")
    assert pushed["webhook_status"] == 200
    update = InboundUpdate.objects.get(bot=bot)
    assert update.state == UpdateState.NEW

    # The sweeper runs later; make the update look overdue instead of sleeping 30 s.
    InboundUpdate.objects.filter(pk=update.pk).update(next_attempt_at=update.next_attempt_at - redispatch_grace() * 2)
    report = sweep()

    assert report["updates_redispatched"] == 1
    wait_until(lambda: sandbox.sent_texts(token=bot.token) == ["Echo: are you there?"], timeout=30)
