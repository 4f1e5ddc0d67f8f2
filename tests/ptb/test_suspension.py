"""Acceptance 6: a handler sending 5 messages into a private chat, which Telegram (and the
outbox's limiter) allow 1 message a second: every message goes under the limit, in order,
and the run waits for each by being deferred, so its one worker handles another chat
meanwhile. The suspension spends no attempt."""

from __future__ import annotations

import itertools

import pytest

from bots.models import RunState
from tests.ptb.support import ptb_worker, run_of, sweep_once, user_writes
from tests.support import Process, wait_until

pytestmark = [pytest.mark.e2e]


def test_five_messages_into_a_chat_limited_to_one_a_second_go_in_order_without_a_429_or_a_held_worker(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(name="ptb-five", responder="none")
    sandbox.limits(per_private_chat_per_second=1)
    ptb_worker(process_env, processes, name="only")  # one worker, one task at a time
    five = user_writes(sandbox, bot, 9600, "five")
    wait_until(lambda: len(sandbox.calls(token=bot.token, method="sendMessage")) >= 1, timeout=30)
    other = user_writes(sandbox, bot, 9601, "hello")

    def both_done() -> bool:
        sweep_once()
        return run_of(five, "ptb_five").state == run_of(other, "ptb_five").state == RunState.DONE

    wait_until(both_done, timeout=90, interval=0.5, message="both runs done")

    sends = sandbox.calls(token=bot.token, method="sendMessage")
    assert [c["status"] for c in sends] == [200] * 6  # no 429
    assert sandbox.sent_texts(token=bot.token, chat_id=9600) == [f"part {n} of 5" for n in range(1, 6)]
    # The other chat's answer went while the first run waited for its slots: the worker was free.
    texts = [c["params"]["text"] for c in sends]
    assert texts.index("good morning from run a") < texts.index("part 5 of 5")
    times = [c["at"] for c in sends if c["chat_id"] == 9600]
    assert all(later - earlier >= 0.9 for earlier, later in itertools.pairwise(times))
    assert run_of(five, "ptb_five").attempts == 1


def test_a_send_that_telegram_refuses_with_a_502_is_retried_by_the_outbox_while_the_run_waits(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    from outbox.models import OutboundMessage

    bot = bot_factory(name="ptb-echo", responder="none")
    sandbox.fault("502", method="sendMessage", count=1, token=bot.token)
    ptb_worker(process_env, processes, name="only")
    update = user_writes(sandbox, bot, 9700, "are you there?")

    def done() -> bool:
        sweep_once()
        return run_of(update, "ptb_echo").state == RunState.DONE

    wait_until(done, timeout=60, interval=0.5, message="the run done")
    assert sandbox.sent_texts(token=bot.token) == ["are you there?"]
    assert [c["status"] for c in sandbox.calls(token=bot.token, method="sendMessage")] == [502, 200]
    assert OutboundMessage.objects.get(source_update=update, consumer="ptb_echo").attempts == 2
    assert run_of(update, "ptb_echo").attempts == 1  # waiting for the retry spent none of the run's
