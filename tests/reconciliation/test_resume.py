"""After an outage, a process takes up its own claims and hands on what waits
(reconciliation/resume.py): no lease or sweeper tick to wait for."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.utils import timezone

from bots.models import ConsumerRun, RunState
from core.workers import lease_keeper, worker_id
from outbox.models import OutboundMessage, State
from outbox.sending import batch
from outbox.sending.late import late_answers
from outbox.sending.single import outbound_message_send
from reconciliation import resume
from reconciliation.models import CaseStatus, ReconciliationCase
from tests.conftest import _delete_run_keys
from tests.reconciliation.factories import message_row, open_attempt, stored_update
from tests.support import queued, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def claimed(bot, key: str, *, owner: str, at) -> OutboundMessage:
    """A send claimed by `owner` at `at`, its lease far from expired (the sweeper would wait)."""
    row = message_row(bot, key=key, state=State.SENDING, chat_id=hash(key) % 1000, lease_owner=owner)
    OutboundMessage.objects.filter(pk=row.pk).update(updated_at=at, lease_expires_at=at + timedelta(seconds=60))
    return row


def test_a_process_takes_up_the_sends_it_had_claimed_before_the_outage_and_only_those(bot) -> None:
    outage = timezone.now()
    earlier, later = outage - timedelta(seconds=1), outage + timedelta(seconds=1)
    mine = claimed(bot, "mine", owner=worker_id(), at=earlier)
    in_flight = claimed(bot, "in-flight", owner=worker_id(), at=earlier)
    open_attempt(in_flight)  # its request had started: nobody knows whether it went
    theirs = claimed(bot, "theirs", owner="other:1", at=earlier)
    since = claimed(bot, "since", owner=worker_id(), at=later)  # claimed after the outage

    report = resume.own_claims(outage)

    assert (report["sends_released"], report["sends_unknown"]) == (1, 1)
    state = dict(OutboundMessage.objects.values_list("pk", "state"))
    assert state[mine.pk] == State.PENDING
    assert state[in_flight.pk] == State.UNKNOWN
    assert ReconciliationCase.objects.get(message=in_flight).status == CaseStatus.OPEN
    assert (state[theirs.pk], state[since.pk]) == (State.SENDING, State.SENDING)
    assert [t.name for t in queued()] == ["outbox.drain_bot"]


def test_a_process_retries_the_runs_it_had_claimed_before_the_outage_without_spending_their_budget(bot) -> None:
    update = stored_update(bot)
    run = ConsumerRun.objects.create(
        update=update,
        bot_id=bot.pk,
        consumer="analytics",
        state=RunState.RUNNING,
        lease_owner=worker_id(),
        lease_expires_at=timezone.now() + timedelta(seconds=15),
        attempts=1,
        max_attempts=3,
        next_attempt_at=timezone.now(),
    )

    assert resume.own_claims(timezone.now() + timedelta(seconds=1))["runs_retried"] == 1

    run.refresh_from_db()
    assert (run.state, run.lease_owner, run.max_attempts) == (RunState.RETRY, "", 4)
    assert run.next_attempt_at <= timezone.now()
    assert "bots.run_consumer" in [t.name for t in queued()]


def test_a_run_this_process_still_works_on_is_not_taken_up_after_an_outage(bot) -> None:
    # An awaiting run on the event loop (a model call in flight) lives through a restart of
    # PostgreSQL: released, it would be run a second time and its model asked twice.
    update = stored_update(bot)
    alive, cut_off = (
        ConsumerRun.objects.create(
            update=update,
            bot_id=bot.pk,
            consumer=consumer,
            state=RunState.RUNNING,
            lease_owner=worker_id(),
            lease_expires_at=timezone.now() + timedelta(seconds=15),
            attempts=1,
            max_attempts=3,
            next_attempt_at=timezone.now(),
        )
        for consumer in ("auto_reply", "analytics")
    )

    with lease_keeper.holding("run", [alive.pk]):
        assert resume.own_claims(timezone.now() + timedelta(seconds=1))["runs_retried"] == 1

    alive.refresh_from_db()
    cut_off.refresh_from_db()
    assert (alive.state, alive.lease_owner) == (RunState.RUNNING, worker_id())
    assert cut_off.state == RunState.RETRY


def _no_send_is_taken_up_while_its_request_is_out(bot, sandbox, send, wait_for_answer) -> None:
    """`send` sends a due message (its request answered slowly), and returns with it still out;
    an outage noted meanwhile, this process takes up its claims: not that send, which its
    answer then settles, but a claim of this process's it no longer works on, as before."""
    waiting = message_row(bot, key="out", chat_id=77)
    cut_off = claimed(bot, "cut-off", owner=worker_id(), at=timezone.now() - timedelta(seconds=1))
    open_attempt(cut_off)
    sandbox.fault("slow", method="sendMessage", delay=1.5, count=1, token=bot.token)
    send(waiting.pk)
    wait_until(lambda: sandbox.calls(token=bot.token, method="sendMessage"), message="the request")

    try:
        report = resume.own_claims(timezone.now() + timedelta(seconds=1))
        state = OutboundMessage.objects.values_list("state", "lease_owner").get(pk=waiting.pk)
    finally:
        wait_for_answer()  # the send ends within this test, whatever own_claims did

    assert (report["sends_released"], report["sends_unknown"]) == (0, 1)
    assert state == (State.SENDING, worker_id())
    waiting.refresh_from_db()
    assert waiting.state == State.SENT
    assert [a.outcome for a in waiting.attempt_set.all()] == ["ok"]
    assert list(ReconciliationCase.objects.values_list("message_id", flat=True)) == [cut_off.pk]
    assert OutboundMessage.objects.get(pk=cut_off.pk).state == State.UNKNOWN
    assert waiting.pk not in lease_keeper.held("send")


def test_a_send_whose_late_answer_this_process_awaits_is_not_taken_up_after_an_outage(bot, sandbox) -> None:
    # The inline send hands its slow answer to the late-answers thread and goes on: Redis
    # restarting empty meanwhile, that send would become unknown and its answer open a case.
    def send(pk: int) -> None:
        assert batch.outbound_messages_send_now(bot.pk, [pk]) == []

    _no_send_is_taken_up_while_its_request_is_out(bot, sandbox, send, lambda: late_answers.drain(timeout=15))


def test_a_single_send_this_process_awaits_is_not_taken_up_after_an_outage(bot, sandbox) -> None:
    threads: list[threading.Thread] = []

    def send(pk: int) -> None:
        def run() -> None:
            try:
                outbound_message_send(pk)
            finally:
                connection.close()

        threads.append(threading.Thread(target=run))
        threads[0].start()

    _no_send_is_taken_up_while_its_request_is_out(bot, sandbox, send, lambda: threads[0].join(15))


def test_once_for_all_processes_what_waits_is_handed_on(bot) -> None:
    stored_update(bot)
    message_row(bot, key="due", chat_id=5)
    # Redis restarted empty: the router's task and its wake-up key are gone (this run's keys).
    _delete_run_keys(redis.Redis.from_url(settings.REDIS_URL))

    first = resume.hand_on_waiting()

    assert (first["routers"], first["drains"]) == (1, 1)
    assert sorted(t.name for t in queued()) == ["bots.route_bot", "outbox.drain_bot"]
