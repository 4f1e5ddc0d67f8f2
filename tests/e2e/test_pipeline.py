"""The inbox pipeline with real processes: sandbox -> webhook (gunicorn) -> inbox -> consumer
runs (Celery worker) -> outbox -> sandbox, with a local fake CRM over HTTP; and the poller
as a real process stopped with Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator

import pytest
from django.core.management import call_command

from bots.models import AnalyticsEvent, Bot, ConsumerRun, InboundUpdate, RunState
from outbox.models import OutboundMessage, State
from tests.bots.fakes import FakeCRM
from tests.support import Process, start_worker, wait_until

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def crm() -> Iterator[FakeCRM]:
    server = FakeCRM().start()
    yield server
    server.stop()


def json_lines(log: str) -> list[dict]:
    lines = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


def test_a_failing_crm_does_not_hold_up_the_reply_and_its_retry_creates_no_duplicate_lead(
    process_env: dict, processes: list, web: str, sandbox, bot_factory, crm: FakeCRM
) -> None:
    worker = start_worker(
        {**process_env, "DOVECOTE_CRM_WEBHOOK_URL": crm.url, "DOVECOTE_CRM_LOOKUP": "tests.bots.fakes.crm_lookup"}
    )
    processes.append(worker)
    bot = bot_factory(webhook_secret="alices-secret")
    call_command("set_webhook", bot.name, "--url", web)
    # The CRM stores the lead but the answer is lost (502): from our side it failed.
    crm.failures = ["lost_answer"]

    pushed = sandbox.push_message(bot.token, chat_id=4242, text="Is the bike still for sale?")
    assert pushed["webhook_status"] == 200
    update = InboundUpdate.objects.get(bot=bot)

    wait_until(lambda: sandbox.sent_texts(token=bot.token, chat_id=4242), timeout=20, message="the auto-reply")
    crm_run = wait_until(
        lambda: ConsumerRun.objects.filter(update=update, consumer="crm_webhook", state=RunState.DONE).first(),
        timeout=20,
        message="the CRM run to succeed on retry",
    )
    wait_until(lambda: AnalyticsEvent.objects.filter(update=update).exists(), timeout=10)

    assert sandbox.sent_texts(token=bot.token, chat_id=4242) == ["Echo: Is the bike still for sale?"]
    assert crm_run.attempts == 2
    assert crm_run.outcome == "found-in-crm"  # the lookup found the lead before any resend
    assert len(crm.posts) == 1
    assert list(crm.leads.values()) == [1]

    # One trace id from the webhook through every row of this update...
    trace_id = update.trace_id
    runs = ConsumerRun.objects.filter(update=update)
    assert {r.consumer for r in runs} == {"auto_reply", "crm_webhook", "analytics"}
    assert {r.trace_id for r in runs} == {trace_id}
    assert OutboundMessage.objects.get(bot=bot).trace_id == trace_id
    assert crm.posts[0]["body"]["trace_id"] == trace_id
    # ...and on the worker's JSON log lines about it; no line carries another task's trace.
    lines = json_lines(worker.log())
    ours = [line["message"] for line in lines if line.get("trace_id") == trace_id]
    # The echo and analytics ran in the router's task: its one line says so.
    assert any(
        "routed to auto_reply, crm_webhook, analytics; ran here: auto_reply done, analytics done" in m for m in ours
    )
    assert any(m.startswith("consumer crm_webhook failed") for m in ours)
    assert {line.get("trace_id") for line in lines} <= {"", trace_id}


def test_a_burst_of_three_messages_gets_one_reply_and_a_later_message_its_own(
    process_env: dict, processes: list, web: str, sandbox, bot_factory
) -> None:
    processes.append(start_worker({**process_env, "DOVECOTE_REPLY_DEBOUNCE_SECONDS": "1"}))
    bot = bot_factory()
    call_command("set_webhook", bot.name, "--url", web)

    for text in ["Hi", "Still available?", "Delivery?"]:
        assert sandbox.push_message(bot.token, chat_id=77, text=text)["webhook_status"] == 200

    wait_until(lambda: sandbox.sent_texts(token=bot.token, chat_id=77), timeout=20, message="the burst's reply")
    assert sandbox.sent_texts(token=bot.token, chat_id=77) == ["Echo: Hi\nStill available?\nDelivery?"]

    sandbox.push_message(bot.token, chat_id=77, text="Hello??")
    wait_until(lambda: len(sandbox.sent_texts(token=bot.token, chat_id=77)) == 2, timeout=20, message="2nd reply")
    assert sandbox.sent_texts(token=bot.token, chat_id=77)[1] == "Echo: Hello??"
    outcomes = sorted(ConsumerRun.objects.filter(bot=bot, consumer="auto_reply").values_list("outcome", flat=True))
    assert outcomes == ["answered 1", "answered 3", "coalesced", "coalesced"]
    # The sandbox records a request before the worker has its answer and marks the row sent.
    wait_until(
        lambda: OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() >= 2, timeout=10, message="marked"
    )
    assert OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 2


def test_poll_updates_stores_what_arrives_and_stops_cleanly_on_ctrl_c(
    process_env: dict, processes: list, sandbox, bot_factory
) -> None:
    bot = bot_factory()
    poller = Process("poller", [sys.executable, "manage.py", "poll_updates", bot.name, "--timeout", "10"], process_env)
    processes.append(poller)
    wait_until(lambda: "Polling" in poller.log() or not poller.alive(), timeout=20, message="poller started")

    pushed = sandbox.push_message(bot.token, chat_id=9, text="no public URL here")
    assert pushed.get("queued") is True
    update = wait_until(lambda: InboundUpdate.objects.filter(bot=bot).first(), timeout=10, message="stored")
    assert update.text == "no public URL here"

    os.kill(poller.pid, signal.SIGINT)
    assert poller.proc.wait(5) == 0
    assert "Stopped; next offset" in poller.log()
    assert Bot.objects.get(pk=bot.pk).polling_offset == pushed["update"]["update_id"] + 1
