"""The python-telegram-bot path driven in this process, hop by hop: route, run, send."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bots import registry
from bots.models import ConsumerRun, RunState
from bots.ptb import ptb_consumer
from bots.ptb.models import CallKind, HandlerCall
from bots.routing import inbox_update_route
from bots.runs import consumer_run_execute
from outbox.models import OutboundMessage, State
from tests.ptb.support import user_presses, user_writes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.hop_by_hop]


def example_bot(bot_factory, example: str):
    """A bot whose updates python-telegram-bot's example `example` handles (consumer
    inproc_<example>), registered in this process for the test."""
    bot = bot_factory(name=f"inproc-{example}", responder="none")
    ptb_consumer(f"inproc_{example}", bot=bot.name, main=f"tests.ptb.examples.{example}:main")
    yield bot
    registry.unregister(f"inproc_{example}")


@pytest.fixture
def echo_bot(bot_factory):
    yield from example_bot(bot_factory, "echobot")


def handle(update) -> str:
    inbox_update_route(update.pk)
    run = ConsumerRun.objects.get(update=update, consumer="inproc_echobot")
    return consumer_run_execute(run.pk)


def test_an_echo_is_sent_once_through_the_outbox_and_journaled(echo_bot, sandbox) -> None:
    update = user_writes(sandbox, echo_bot, 7001, "hello there")
    assert handle(update) == "done"

    assert sandbox.sent_texts(token=echo_bot.token) == ["hello there"]
    call = HandlerCall.objects.get(update=update, consumer="inproc_echobot")
    assert (call.ordinal, call.method, call.target, call.kind, call.ok) == (
        0,
        "sendMessage",
        "chat_id=7001",
        CallKind.OUTBOX,
        True,
    )
    assert call.result["text"] == "hello there"
    message = OutboundMessage.objects.get(pk=call.message_id)
    assert message.state == State.SENT
    assert message.result["message_id"] == message.telegram_message_id
    run = ConsumerRun.objects.get(update=update, consumer="inproc_echobot")
    assert (run.state, run.attempts) == (RunState.DONE, 1)


def test_a_rerun_replays_the_journal_and_sends_nothing_again(echo_bot, sandbox) -> None:
    update = user_writes(sandbox, echo_bot, 7002, "once")
    assert handle(update) == "done"
    run = ConsumerRun.objects.get(update=update, consumer="inproc_echobot")
    ConsumerRun.objects.filter(pk=run.pk).update(state=RunState.PENDING)

    assert consumer_run_execute(run.pk) == "done"
    assert sandbox.sent_texts(token=echo_bot.token) == ["once"]
    assert HandlerCall.objects.filter(update=update).count() == 1


@pytest.fixture
def timer_bot(bot_factory):
    yield from example_bot(bot_factory, "timerbot")


def test_timerbot_s_job_queue_is_a_dead_letter_saying_why(timer_bot, sandbox) -> None:
    update = user_writes(sandbox, timer_bot, 7101, "/set 5")
    inbox_update_route(update.pk)
    run = ConsumerRun.objects.get(update=update, consumer="inproc_timerbot")
    assert consumer_run_execute(run.pk) == "dead-lettered"


@pytest.fixture
def keyboard_bot(bot_factory):
    yield from example_bot(bot_factory, "inlinekeyboard")


def test_telegram_s_400_is_replayed_to_a_rerun_from_the_journal(keyboard_bot, sandbox) -> None:
    def run(update) -> tuple[str, ConsumerRun]:
        inbox_update_route(update.pk)
        row = ConsumerRun.objects.get(update=update, consumer="inproc_inlinekeyboard")
        return consumer_run_execute(row.pk), row

    assert run(user_writes(sandbox, keyboard_bot, 7201, "/start"))[0] == "done"
    menu = HandlerCall.objects.get(consumer="inproc_inlinekeyboard").result
    press = {"message_id": menu["message_id"]}
    assert run(user_presses(sandbox, keyboard_bot, 7201, "3", **press))[0] == "done"
    outcome, again = run(user_presses(sandbox, keyboard_bot, 7201, "3", **press))
    assert outcome == "dead-lettered"
    edits = len(sandbox.calls(token=keyboard_bot.token, method="editMessageText"))
    assert edits == 2

    # An operator runs it again: the journal answers both calls, Telegram is not asked.
    ConsumerRun.objects.filter(pk=again.pk).update(state=RunState.PENDING)
    assert consumer_run_execute(again.pk) == "dead-lettered"
    assert len(sandbox.calls(token=keyboard_bot.token, method="editMessageText")) == edits
    assert len(sandbox.calls(token=keyboard_bot.token, method="answerCallbackQuery")) == 2


@pytest.fixture
def conversation_bot(bot_factory):
    yield from example_bot(bot_factory, "conversationbot")


@pytest.fixture
def photo_file():
    """conversationbot.py downloads the user's photo to ./user_photo.jpg (its own choice)."""
    path = Path("user_photo.jpg")
    yield path
    path.unlink(missing_ok=True)


def test_a_photo_is_got_live_downloaded_and_its_getfile_journaled(conversation_bot, sandbox, photo_file) -> None:
    def run(update) -> str:
        """Until the run is settled: a private chat takes a message a second, so a prompt
        right after another defers its run (this test is the worker that runs it again)."""
        inbox_update_route(update.pk)
        run = ConsumerRun.objects.get(update=update, consumer="inproc_conversationbot")
        outcome = consumer_run_execute(run.pk)
        deadline = time.monotonic() + 10
        while outcome in ("deferred", "not-due") and time.monotonic() < deadline:
            time.sleep(0.2)
            outcome = consumer_run_execute(run.pk)
        return outcome

    assert run(user_writes(sandbox, conversation_bot, 7301, "/start")) == "done"
    assert run(user_writes(sandbox, conversation_bot, 7301, "Boy")) == "done"
    photo = user_writes(sandbox, conversation_bot, 7301, "", photo=True)
    assert run(photo) == "done"

    assert sandbox.sent_texts(token=conversation_bot.token)[-1] == (
        "Gorgeous! Now, send me your location please, or send /skip if you don't want to."
    )
    get_file, reply = HandlerCall.objects.filter(update=photo).order_by("ordinal")
    assert (get_file.method, get_file.kind, get_file.ok) == ("getFile", CallKind.READ, True)
    assert get_file.result["file_path"].startswith("photos/")
    assert photo_file.read_bytes().startswith(b"sandbox photo 800x600")
    assert reply.method == "sendMessage"


@pytest.fixture
def upload_bot(bot_factory):
    bot = bot_factory(name="inproc-upload", responder="none")
    ptb_consumer("inproc_upload", bot=bot.name, setup="tests.ptb.handlers:add_upload")
    yield bot
    registry.unregister("inproc_upload")


def test_an_upload_goes_through_the_effect_ledger_once_and_its_message_is_the_handler_s(upload_bot, sandbox) -> None:
    update = user_writes(sandbox, upload_bot, 7401, "draw me something")
    inbox_update_route(update.pk)
    run = ConsumerRun.objects.get(update=update, consumer="inproc_upload")
    assert consumer_run_execute(run.pk) == "done"

    photo = sandbox.calls(token=upload_bot.token, method="sendPhoto")
    assert len(photo) == 1
    assert photo[0]["delivered"] is True
    upload_call, reply = HandlerCall.objects.filter(update=update).order_by("ordinal")
    assert (upload_call.method, upload_call.kind, upload_call.ok) == ("sendPhoto", CallKind.EFFECT, True)
    assert sandbox.sent_texts(token=upload_bot.token) == [f"that was message {upload_call.result['message_id']}"]
    assert reply.kind == CallKind.OUTBOX

    ConsumerRun.objects.filter(pk=run.pk).update(state=RunState.PENDING)
    assert consumer_run_execute(run.pk) == "done"
    assert len(sandbox.calls(token=upload_bot.token, method="sendPhoto")) == 1
