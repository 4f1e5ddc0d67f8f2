"""Inline work is bounded: a slow Bot API does not hold up routing, a live worker keeps the
runs it works on however long they take, and a dead one's runs are taken over within the
short lease (DOVECOTE_CONSUMER_LEASE_SECONDS), not after minutes."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from bots.models import ConsumerRun, InboundUpdate, RunState
from outbox.models import Attempt, OutboundMessage, State
from reconciliation.sweeper import sweep
from tests.support import start_web, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

NO_GRACE = override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0)


def test_a_slow_bot_api_does_not_hold_up_the_routing_of_the_next_update(
    process_env: dict[str, str], processes: list, sandbox, bot_factory
) -> None:
    bot = bot_factory(responder="echo")
    worker = start_worker(process_env, concurrency=1)  # one process: the router is all there is
    processes.append(worker)
    web, url = start_web(process_env)
    processes.append(web)
    call_command("set_webhook", bot.name, "--url", url)
    sandbox.fault("slow", token=bot.token, chat_id=701, delay=8.0, count=1)

    sandbox.push_message(bot.token, chat_id=701, text="first")
    first = wait_until(
        lambda: OutboundMessage.objects.filter(bot=bot, chat_id=701, attempts=1).first(),
        timeout=30,
        message="the first reply's request is out",
    )
    sandbox.push_message(bot.token, chat_id=702, text="second")

    # The second update is routed, run and its reply sent while the first answer is still
    # out: the router did not wait for Telegram.
    wait_until(
        lambda: sandbox.sent_texts(token=bot.token, chat_id=702) == ["Echo: second"],
        timeout=6,
        message="the second reply sent before the first answer came",
    )
    first.refresh_from_db()
    assert first.state == State.SENDING
    # The first answer is recorded by the worker when it comes, once.
    wait_until(lambda: OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 2, timeout=30)
    assert sandbox.sent_texts(token=bot.token, chat_id=701) == ["Echo: first"]
    assert Attempt.objects.filter(message__bot=bot).count() == 2
    assert "late answers" not in worker.log()  # no error recording them


def test_a_live_worker_keeps_a_run_longer_than_its_lease_and_nobody_takes_it_over(
    process_env: dict[str, str], processes: list, bot_factory
) -> None:
    from bots.inbox import inbox_update_store
    from bots.routing import inbox_router_wake
    from tests.bots.fakes import message_update

    lease = 1  # renewed every third of a second by the worker that runs it
    env = {
        **process_env,
        "DJANGO_SETTINGS_MODULE": "tests.bots.chatorder.settings",
        "DOVECOTE_CONSUMER_LEASE_SECONDS": str(lease),
    }
    processes.append(start_worker(env, concurrency=2))
    bot = bot_factory(responder="none")
    update, _ = inbox_update_store(bot=bot, payload=message_update(chat_id=88, text="long work", message_id=1))
    inbox_router_wake(bot.pk, update.pk)
    run = wait_until(
        lambda: ConsumerRun.objects.filter(update=update, consumer="long_runner", state=RunState.RUNNING).first(),
        timeout=30,
        message="the long run started",
    )
    # The run takes 4 s, four leases: sweeps meanwhile find its lease alive every time.
    released = 0
    with NO_GRACE:
        while ConsumerRun.objects.filter(pk=run.pk, state=RunState.RUNNING).exists():
            released += sweep()["runs_released"]
            time.sleep(0.5)
    run.refresh_from_db()
    assert (run.state, run.attempts, run.outcome, released) == (RunState.DONE, 1, "worked", 0)


def test_a_killed_routers_inline_runs_are_taken_over_within_the_default_lease(
    process_env: dict[str, str], processes: list, sandbox, bot_factory
) -> None:
    from bots.inbox import inbox_update_store
    from bots.routing import inbox_router_wake
    from tests.bots.fakes import message_update

    assert settings.DOVECOTE_CONSUMER_LEASE_SECONDS <= 30  # the production default under test
    bot = bot_factory(responder="echo")
    env = {**process_env, "DOVECOTE_FAILPOINTS": "after_inline_runs", "DOVECOTE_SEND_LEASE_SECONDS": "50"}
    doomed = start_worker(env, pool="solo", concurrency=1, name="router-doomed")
    processes.append(doomed)
    update, _ = inbox_update_store(bot=bot, payload=message_update(chat_id=4545, text="ping", message_id=1))
    inbox_router_wake(bot.pk, update.pk)
    wait_until(lambda: not doomed.alive(), timeout=30, message="the router killed itself after its inline runs")
    killed_at = timezone.now()
    runs = ConsumerRun.objects.filter(update=update)
    assert {r.state for r in runs} == {RunState.RUNNING}
    lease = timedelta(seconds=settings.DOVECOTE_CONSUMER_LEASE_SECONDS)
    assert all(r.lease_expires_at <= killed_at + lease for r in runs)

    processes.append(start_worker(process_env, name="router-next"))
    wait_until(lambda: all(r.lease_expires_at < timezone.now() for r in runs.all()), timeout=lease.seconds + 5)
    with NO_GRACE:
        assert sweep()["runs_released"] == 2
    wait_until(lambda: runs.filter(state=RunState.DONE).count() == 2, timeout=30, message="the runs re-ran")
    assert InboundUpdate.objects.filter(pk=update.pk).exists()
