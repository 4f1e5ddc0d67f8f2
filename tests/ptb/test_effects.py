"""Acceptance 4, 5 and 7: a callback answer through the effect ledger (inlinekeyboard.py),
handlers that are not deterministic, and timerbot.py's job queue, with real workers."""

from __future__ import annotations

import pytest

from bots.models import RunState
from bots.ptb.models import HandlerCall
from outbox.models import DeadLetter, Effect, EffectState
from tests.ptb.support import ptb_worker, run_of, sweep_once, user_presses, user_writes
from tests.support import Process, wait_until

pytestmark = [pytest.mark.e2e]


def methods(sandbox, bot) -> list[str]:
    """The bot's calls in the sandbox, without each worker's getMe at its application's start."""
    return [c["method"] for c in sandbox.calls(token=bot.token) if c["method"] != "getMe"]


def settled(update, consumer: str, state: str):
    def check() -> bool:
        sweep_once()
        return run_of(update, consumer).state == state

    return check


def test_inlinekeyboard_a_kill_between_the_callback_answer_and_the_edit_performs_each_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(name="ptb-keyboard", responder="none")
    chat = 9500
    doomed = ptb_worker(process_env, processes, failpoint="ptb_after_effect", name="doomed")
    start = user_writes(sandbox, bot, chat, "/start")
    wait_until(settled(start, "ptb_keyboard", RunState.DONE), timeout=30, message="the keyboard sent")
    menu = HandlerCall.objects.get(update=start).result
    assert menu["text"] == "Please choose:"

    press = user_presses(sandbox, bot, chat, "2", message_id=menu["message_id"])
    wait_until(lambda: not doomed.alive(), timeout=30, message="the worker to die after the callback answer")
    assert methods(sandbox, bot) == ["sendMessage", "answerCallbackQuery"]

    ptb_worker(process_env, processes, name="fresh")
    wait_until(settled(press, "ptb_keyboard", RunState.DONE), timeout=60, message="the press handled")
    assert methods(sandbox, bot) == [
        "sendMessage",
        "answerCallbackQuery",
        "editMessageText",
    ]
    assert sandbox.messages(token=bot.token, chat_id=chat)[0]["message"]["text"] == "Selected option: 2"
    assert Effect.objects.get().state == EffectState.DONE

    # The same button again: Telegram's 400 reaches the handler, and the run is a dead
    # letter at once, not a retry loop.
    again = user_presses(sandbox, bot, chat, "2", message_id=menu["message_id"])
    wait_until(settled(again, "ptb_keyboard", RunState.FAILED), timeout=60, message="the second press dead-lettered")
    run = run_of(again, "ptb_keyboard")
    assert run.attempts == 1
    letter = DeadLetter.objects.get(consumer_run=run)
    assert "message is not modified" in letter.last_error.lower()
    edit = HandlerCall.objects.get(update=again, method="editMessageText")
    assert edit.ok is False
    assert "message is not modified" in edit.error["description"].lower()
    assert methods(sandbox, bot)[3:] == ["answerCallbackQuery", "editMessageText"]


def killed_then_rerun(process_env, processes, sandbox, bot, consumer: str, *, rerun_state: str):
    """The bot's handler runs in a worker whose handler takes branch "a" and dies before the
    run's commit; a fresh worker, whose handler takes branch "b", runs it again."""
    branch = {"PTB_TEST_BRANCH": "a"}
    doomed = ptb_worker(process_env, processes, failpoint="ptb_before_commit", name="doomed", env=branch)
    update = user_writes(sandbox, bot, 9510, "good morning")
    wait_until(lambda: not doomed.alive(), timeout=30, message="the worker to die before the run's commit")
    ptb_worker(process_env, processes, name="fresh", env={"PTB_TEST_BRANCH": "b"})
    wait_until(settled(update, consumer, rerun_state), timeout=60, message=f"the rerun {rerun_state}")
    return run_of(update, consumer)


def test_a_handler_that_branches_differently_on_its_rerun_is_a_dead_letter_and_sends_nothing_more(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(name="ptb-branching", responder="none")
    run = killed_then_rerun(process_env, processes, sandbox, bot, "ptb_branching", rerun_state=RunState.FAILED)

    assert sandbox.sent_texts(token=bot.token) == ["heads", "and that is all"]
    assert sandbox.calls(token=bot.token, method="sendDice") == []
    letter = DeadLetter.objects.get(consumer_run=run)
    assert "handler not deterministic" in letter.last_error
    assert letter.reason_class == "permanent"


def test_a_handler_whose_rerun_only_changes_its_text_delivers_the_first_text_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(name="ptb-varying", responder="none")
    killed_then_rerun(process_env, processes, sandbox, bot, "ptb_varying", rerun_state=RunState.DONE)
    assert sandbox.sent_texts(token=bot.token) == ["good morning from run a"]


def test_timerbot_s_job_queue_is_a_clear_dead_letter(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(name="ptb-timer", responder="none")
    ptb_worker(process_env, processes, name="worker")
    hello = user_writes(sandbox, bot, 9530, "/start")
    timer = user_writes(sandbox, bot, 9530, "/set 5")
    wait_until(settled(timer, "ptb_timer", RunState.FAILED), timeout=60, message="the /set run dead-lettered")

    assert run_of(hello, "ptb_timer").state == RunState.DONE
    assert sandbox.sent_texts(token=bot.token) == ["Hi! Use /set <seconds> to set a timer"]
    letter = DeadLetter.objects.get(consumer_run=run_of(timer, "ptb_timer"))
    assert "the job queue is not available" in letter.last_error
    assert run_of(timer, "ptb_timer").attempts == 1
