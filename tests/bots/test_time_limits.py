"""A consumer run has a time limit: overrunning it is a failed attempt, retried with backoff
and dead-lettered when the budget is spent. The limit may be longer than the run's lease,
which its live worker renews; a limit of 0 is refused at start-up (system check and worker)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from bots import registry
from bots.inbox import inbox_update_store
from bots.models import ConsumerRun, RunState
from outbox.models import DeadLetter
from tests.bots.fakes import execute, message_update, receive, run_of
from tests.support import Process, start_worker, wait_until


@pytest.fixture
def interrupted() -> Iterator[None]:
    """A consumer interrupted the way Celery's soft time limit interrupts it."""

    @registry.consumer("interrupted", update_types=["message"], max_attempts=2, backoff=(0.1,), timeout=2)
    def interrupted(ctx: registry.ConsumerContext) -> None:
        raise SoftTimeLimitExceeded("SoftTimeLimitExceeded()")

    yield
    registry.unregister("interrupted")


@pytest.mark.django_db
def test_a_run_interrupted_by_its_time_limit_is_a_transient_failure_then_a_dead_letter(bot, interrupted) -> None:
    update = receive(bot, message_update(chat_id=5, text="slow", message_id=1))

    assert execute(update, "interrupted") == "retry"
    run = run_of(update, "interrupted")
    assert (run.state, run.attempts, run.last_error_class) == (RunState.RETRY, 1, "transient")
    assert run.last_error == "timed out: still running after the consumer's time limit of 2s"

    assert execute(update, "interrupted", due_now=True) == "dead-lettered"
    run.refresh_from_db()
    assert (run.state, run.attempts, run.last_error_class) == (RunState.FAILED, 2, "exhausted")
    assert DeadLetter.objects.get(consumer_run=run).reason_class == "exhausted"


@override_settings(DOVECOTE_CONSUMER_LEASE_SECONDS=300, DOVECOTE_CONSUMER_TIMEOUT_SECONDS=240)
def test_a_consumer_without_its_own_timeout_gets_the_default() -> None:
    @registry.consumer("defaulted")
    def defaulted(ctx: registry.ConsumerContext) -> None:
        return None

    try:
        assert registry.get("defaulted").time_limit() == 240
    finally:
        registry.unregister("defaulted")


def test_a_consumer_whose_timeout_is_not_above_zero_fails_the_system_check() -> None:
    @registry.consumer("instant", timeout=0)
    def instant(ctx: registry.ConsumerContext) -> None:
        return None

    try:
        with pytest.raises(SystemCheckError, match="instant"):
            call_command("check")
    finally:
        registry.unregister("instant")
    call_command("check")  # the built-in consumers and the default are fine


def test_a_consumer_timeout_longer_than_the_lease_passes_the_system_check() -> None:
    # The lease is renewed by the run's live worker (core/workers.py): no relation to hold.
    @registry.consumer("patient", timeout=600)
    def patient(ctx: registry.ConsumerContext) -> None:
        return None

    try:
        with override_settings(DOVECOTE_CONSUMER_LEASE_SECONDS=15):
            call_command("check")
    finally:
        registry.unregister("patient")


@pytest.mark.e2e
def test_a_worker_refuses_to_start_with_a_default_timeout_of_zero(process_env: dict[str, str]) -> None:
    env = {**process_env, "DOVECOTE_CONSUMER_TIMEOUT_SECONDS": "0"}
    with pytest.raises(AssertionError, match="DOVECOTE_CONSUMER_TIMEOUT_SECONDS=0"):
        start_worker(env, name="worker-refused")


@pytest.mark.e2e
def test_a_consumer_that_overruns_its_time_limit_on_a_real_worker_is_retried_then_dead_lettered(
    process_env: dict[str, str], processes: list[Process], bot_factory
) -> None:
    # tests.bots.sleeper: max_attempts 2, timeout 1 s, sleeps 30 s. (Not imported here: importing
    # it would register the sleeper in this process too.)
    lease = 6
    env = {
        **process_env,
        "DJANGO_SETTINGS_MODULE": "tests.bots.sleeper.settings",
        "DOVECOTE_CONSUMER_LEASE_SECONDS": str(lease),
    }
    worker = start_worker(env, name="worker-sleeper")
    processes.append(worker)
    bot = bot_factory(responder="none")
    started = time.monotonic()

    inbox_update_store(bot=bot, payload=message_update(chat_id=6, text="take your time", message_id=1))
    run = wait_until(
        lambda: ConsumerRun.objects.filter(consumer="sleeper", state=RunState.FAILED).first(),
        timeout=30,
        message="the sleeper's run to be dead-lettered",
    )

    # Two attempts of about a second each (plus the backoff), ended by the soft limit: no
    # lease ran out, no worker process was killed, no sweeper was needed.
    assert time.monotonic() - started < 2 * lease
    assert (run.attempts, run.max_attempts, run.last_error_class) == (2, 2, "exhausted")
    assert "time limit of 1s" in run.last_error
    letter = DeadLetter.objects.get(consumer_run=run)
    assert letter.reason_class == "exhausted"
    assert "time limit" in letter.first_error  # the first attempt's failure, recorded on its retry
    assert "Hard time limit" not in worker.log()
    assert worker.alive()
