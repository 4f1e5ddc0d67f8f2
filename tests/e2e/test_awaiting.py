"""Awaiting runs (bots/aio.py) with real processes: gunicorn, Celery workers, PostgreSQL,
Redis, the Bot API sandbox over HTTP, and a fake OpenAI-compatible model (bots/sandbox/model.py)
that sleeps a set time and counts the calls in flight.

What a user would check: each chat's answers in the sandbox (one each, in order), the runs'
and dead letters' rows, and how many calls the model had in flight at once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.db import close_old_connections
from django.test import override_settings

from bots.models import ConsumerRun, RunState
from bots.sandbox.model import FakeModel
from outbox.models import DeadLetter, OutboundMessage, State
from reconciliation.sweeper import sweep
from tests.private_postgres import PrivatePostgres, django_connection_at, remove_clusters_of_dead_runs
from tests.support import Process, start_web, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

CONCURRENCY = "256"


@pytest.fixture
def model() -> Iterator[FakeModel]:
    fake = FakeModel(delay=1.0).start()
    yield fake
    fake.stop()


def awaiting_env(process_env: dict[str, str], model: FakeModel, **extra: str) -> dict[str, str]:
    return {**process_env, "OPENAI_BASE_URL": model.base_url, "DOVECOTE_ASYNC_CONCURRENCY": CONCURRENCY, **extra}


def serve(env: dict[str, str], processes: list[Process], bot, *, concurrency: int = 2) -> Process:
    """A worker (`concurrency` processes) and a web server for the bot's webhook."""
    worker = start_worker(env, concurrency=concurrency)
    web, url = start_web(env)
    processes += [worker, web]
    call_command("set_webhook", bot.name, "--url", url)
    return worker


def sent(bot) -> int:
    return OutboundMessage.objects.filter(bot=bot, state=State.SENT).count()


def test_one_worker_process_holds_a_crowds_model_calls_at_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory, model: FakeModel
) -> None:
    model.delay = 6.0  # longer than it takes to push the crowd: all of them are asked together
    bot = bot_factory(responder="openai")
    serve(awaiting_env(process_env, model), processes, bot, concurrency=1)
    chats = range(7000, 7040)

    for chat in chats:
        assert sandbox.push_message(bot.token, chat_id=chat, text=f"question {chat}")["webhook_status"] == 200
    wait_until(lambda: sent(bot) == len(chats), timeout=90, message="an answer in every chat")

    for chat in chats:
        assert sandbox.sent_texts(token=bot.token, chat_id=chat) == [f"Model: question {chat}"]
    assert model.calls == len(chats)
    assert model.peak == len(chats)  # one worker process (-c 1), every call in flight together
    runs = ConsumerRun.objects.filter(update__bot=bot, consumer="auto_reply")
    assert {(r.state, r.attempts, r.outcome) for r in runs} == {(RunState.DONE, 1, "answered 1")}


def test_a_chats_answers_keep_the_order_of_its_messages_when_the_model_answers_the_second_first(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory, model: FakeModel
) -> None:
    model.delay = 1.0  # "slow ..." takes 3 s
    bot = bot_factory(responder="openai")
    serve(awaiting_env(process_env, model), processes, bot)

    for chat in (81, 82, 83):
        sandbox.push_message(bot.token, chat_id=chat, text="slow first question")
        sandbox.push_message(bot.token, chat_id=chat, text="second question")
    wait_until(lambda: sent(bot) == 6, timeout=60, message="two answers in each chat")

    for chat in (81, 82, 83):
        assert sandbox.sent_texts(token=bot.token, chat_id=chat) == [
            "Model: slow first question",
            "Model: second question",
        ]
    # The model did answer the second question first.
    answered = sorted(model.requests, key=lambda r: r["at"] + (3.0 if r["text"].startswith("slow") else 1.0))
    assert answered[0]["text"] == "second question"


def awaiting_app_worker(process_env: dict[str, str], processes: list[Process], model: FakeModel) -> Process:
    """A worker with tests.e2e.awaiting's `patient_model` (3 attempts, 2 s each, 0.5 s and 1 s
    apart) beside the built-in consumers."""
    env = awaiting_env(process_env, model, DJANGO_SETTINGS_MODULE="tests.e2e.awaiting.settings")
    worker = start_worker(env, name="worker-awaiting")
    processes.append(worker)
    return worker


def test_a_model_that_never_answers_times_each_run_out_without_holding_up_the_others(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory, model: FakeModel
) -> None:
    from bots.inbox import inbox_update_store
    from tests.bots.fakes import message_update

    model.delay = 0.3
    bot = bot_factory(responder="none")
    awaiting_app_worker(process_env, processes, model)
    stuck, quick = range(91, 95), range(95, 99)
    for n, chat in enumerate([*stuck, *quick]):
        text = "hang on" if chat in stuck else f"quick {chat}"
        inbox_update_store(bot=bot, payload=message_update(chat_id=chat, text=text, message_id=n + 1))

    wait_until(lambda: sent(bot) == len(quick), timeout=30, message="the quick chats answered")
    runs = ConsumerRun.objects.filter(update__bot=bot, consumer="patient_model")
    wait_until(
        lambda: runs.filter(state=RunState.FAILED).count() == len(stuck), timeout=60, message="the stuck runs failed"
    )

    for chat in quick:
        assert sandbox.sent_texts(token=bot.token, chat_id=chat) == [f"Model: quick {chat}"]
        assert sandbox.sent_texts(token=bot.token, chat_id=chat - len(stuck)) == []
    # The quick answers were written before any stuck run's first attempt ran out.
    first_retry = min(r["at"] for r in model.requests if r["text"] == "hang on") + 2.0
    last_quick = max(m.created_at for m in OutboundMessage.objects.filter(bot=bot)).timestamp()
    assert last_quick < first_retry
    for run in runs.filter(update__chat_id__in=stuck):
        assert (run.state, run.attempts, run.last_error_class) == (RunState.FAILED, 3, "exhausted")
        assert "time limit of 2s" in run.last_error
        assert DeadLetter.objects.get(consumer_run=run).reason_class == "exhausted"
    asked = [r for r in model.requests if r["text"] == "hang on"]
    assert len(asked) == 3 * len(stuck)  # each attempt asked once, no more


def test_a_model_answering_429_is_retried_with_backoff_then_dead_lettered(
    process_env: dict[str, str], processes: list[Process], bot_factory, model: FakeModel
) -> None:
    from bots.inbox import inbox_update_store
    from tests.bots.fakes import message_update

    model.mode, model.status = "status", 429
    bot = bot_factory(responder="none")
    awaiting_app_worker(process_env, processes, model)
    for chat in (101, 102, 103):
        inbox_update_store(bot=bot, payload=message_update(chat_id=chat, text=f"busy {chat}", message_id=chat))

    runs = ConsumerRun.objects.filter(update__bot=bot, consumer="patient_model")
    wait_until(lambda: runs.filter(state=RunState.FAILED).count() == 3, timeout=60, message="three runs failed")

    for run in runs:
        assert (run.attempts, run.last_error_class) == (3, "exhausted")
        assert "model endpoint answered 429" in run.last_error
    for chat in (101, 102, 103):
        times = sorted(r["at"] for r in model.requests if r["text"] == f"busy {chat}")
        assert len(times) == 3  # three attempts, never a tight loop
        # The backoff between attempts (0.5 s then 1 s, +-20 %).
        assert times[1] - times[0] >= 0.4
        assert times[2] - times[1] >= 0.8


def test_a_worker_killed_with_a_hundred_model_calls_in_flight_is_taken_over_and_each_chat_answered_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory, model: FakeModel
) -> None:
    model.delay = 8.0  # all hundred asked before the first answers
    # Long enough that a live worker's renewals never miss it on a loaded host (a run taken
    # over from a live worker would ask the model once more); the killed one's run out.
    lease = 6
    env = awaiting_env(process_env, model, DOVECOTE_CONSUMER_LEASE_SECONDS=str(lease))
    bot = bot_factory(responder="openai")
    worker = serve(env, processes, bot)
    chats = range(11000, 11100)
    for chat in chats:
        sandbox.push_message(bot.token, chat_id=chat, text=f"question {chat}")
    wait_until(lambda: model.in_flight >= len(chats), timeout=30, message="a hundred model calls in flight")

    worker.kill()
    assert sent(bot) == 0
    processes.append(start_worker(env, name="worker-2"))
    with override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0, DOVECOTE_CONSUMER_LEASE_SECONDS=lease):

        def answered() -> bool:
            sweep()  # beat's job: the dead worker's runs, once their leases ran out
            return sent(bot) == len(chats)

        wait_until(answered, timeout=120, interval=1.0, message="every chat answered")
    time.sleep(2)  # a duplicate would show up by now

    for chat in chats:
        assert sandbox.sent_texts(token=bot.token, chat_id=chat) == [f"Model: question {chat}"]
    assert len(chats) < model.calls <= 2 * len(chats)  # asked again after the kill, once
    runs = ConsumerRun.objects.filter(update__bot=bot, consumer="auto_reply")
    assert {(r.state, r.attempts) for r in runs} == {(RunState.DONE, 2)}


@pytest.fixture
def crashable_database(transactional_db: None) -> Iterator[tuple[PrivatePostgres, str]]:
    """A PostgreSQL cluster of this test's own, which it crashes (never the shared server),
    migrated, with this process's Django connection on its database."""
    remove_clusters_of_dead_runs()
    server = PrivatePostgres().init()
    server.start()
    try:
        server.create_database("awaiting")
        server.migrate("awaiting")
        with django_connection_at(server, "awaiting"):
            yield server, "awaiting"
    finally:
        server.stop()


def test_a_postgresql_restart_with_a_hundred_model_calls_in_flight_leaves_each_chat_answered_once(
    crashable_database: tuple[PrivatePostgres, str],
    process_env: dict[str, str],
    processes: list[Process],
    sandbox,
    sandbox_server,
    model: FakeModel,
) -> None:
    from tests.conftest import make_bot

    server, name = crashable_database
    model.delay = 8.0  # all hundred asked before the first answers, which come while it is down
    # The fault schedules' lease: the runs whose settling waited out the crash are taken over at
    # its end, and a live worker's renewals do not miss it on a loaded host.
    env = awaiting_env(process_env, model, DATABASE_URL=server.url(name), DOVECOTE_CONSUMER_LEASE_SECONDS="10")
    bot = make_bot(sandbox_server.base_url, responder="openai")
    serve(env, processes, bot)
    chats = range(12000, 12100)
    for chat in chats:
        sandbox.push_message(bot.token, chat_id=chat, text=f"question {chat}")
    wait_until(lambda: model.in_flight >= len(chats), timeout=30, message="a hundred model calls in flight")

    server.crash()  # every backend gone at once, no checkpoint; the model answers meanwhile
    wait_until(lambda: model.answered >= len(chats), timeout=30, message="the model's answers, PostgreSQL down")
    server.start()  # crash recovery
    with override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0, DOVECOTE_CONSUMER_LEASE_SECONDS=10):

        def answered() -> bool:
            close_old_connections()
            sweep()  # beat's job: runs whose settling never got through, once their leases ran out
            return sent(bot) == len(chats)

        wait_until(answered, timeout=120, interval=1.0, message="every chat answered")
    time.sleep(2)  # a duplicate would show up by now

    for chat in chats:
        assert sandbox.sent_texts(token=bot.token, chat_id=chat) == [f"Model: question {chat}"]
    assert model.calls <= 2 * len(chats)  # asked again after the restart, at most once
    runs = ConsumerRun.objects.filter(update__bot=bot, consumer="auto_reply")
    assert {r.state for r in runs} == {RunState.DONE}
