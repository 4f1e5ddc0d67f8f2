"""Two workers write replies into one chat at once: the chat still gets them one at a time,
in the order their writes committed. A reply written (and, with inline work, born claimed)
while another worker's reply to the same chat is written but not yet committed must wait for
it: the rule "only the head of a chat's queue may go" holds across transactions."""

from __future__ import annotations

import time

import pytest
from django.core.management import call_command

from bots.models import ConsumerRun, RunState
from outbox.models import OutboundMessage, State
from tests.support import start_web, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

CHAT = 4242


def test_a_reply_written_while_another_workers_reply_to_the_chat_is_uncommitted_goes_after_it(
    process_env: dict[str, str], processes: list, sandbox, bot_factory
) -> None:
    env = {**process_env, "DJANGO_SETTINGS_MODULE": "tests.bots.chatorder.settings", "DOVECOTE_INLINE_WORK": "1"}
    bot = bot_factory(responder="none")  # only slow_writer answers
    workers = [start_worker(env, concurrency=1, name=f"worker{i}") for i in (1, 2)]
    processes.extend(workers)
    web, url = start_web(env)
    processes.append(web)
    call_command("set_webhook", bot.name, "--url", url)

    assert sandbox.push_message(bot.token, chat_id=CHAT, text="hold 1")["webhook_status"] == 200
    # The first run has written its reply and holds its transaction open.
    wait_until(
        lambda: ConsumerRun.objects.filter(bot=bot, consumer="slow_writer", state=RunState.RUNNING).exists(),
        timeout=30,
        message="the first run is running",
    )
    time.sleep(0.5)
    assert sandbox.push_message(bot.token, chat_id=CHAT, text="go 2")["webhook_status"] == 200

    wait_until(
        lambda: OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 2,
        timeout=60,
        message="both replies sent",
    )
    assert sandbox.sent_texts(token=bot.token, chat_id=CHAT) == ["re: hold 1", "re: go 2"]
    calls = sandbox.calls(token=bot.token, method="sendMessage")
    assert len(calls) == 2
