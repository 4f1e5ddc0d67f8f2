"""Crashes around the restart points of seed 004 (one test per point, named after it, is in
test_restart_points.py), with real processes: a Celery worker (``-P solo``,
so a SIGKILL takes the whole worker down), the Bot API sandbox over HTTP, PostgreSQL and
Redis. The worker kills itself at a named failpoint (DOVECOTE_FAILPOINTS) or is killed by
the test; the sweeper then runs in-process instead of waiting for beat.

For each point: how many messages reached the chat, the final state, the attempts, and
that the idempotency key never changed. An enqueued message goes out through its bot's
drain (outbox/sending/batch.py), so these are the drain's failpoints; the last two tests kill a
drain holding a batch of four.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.apps import apps as django_apps
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from outbox.dispatch import dispatch
from outbox.models import OutboundMessage, State
from outbox.sending.single import outbound_message_send
from outbox.services import outbound_message_enqueue
from reconciliation.models import CaseStatus, ReconciliationCase
from reconciliation.sweeper import sweep
from tests.support import ROOT, Process, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

# The workers here are killed, never left waiting for an answer: dovecote.E001 (a send lease
# longer than a send may take) is silenced for them (project/test_settings.py).
SHORT_SEND_LEASE_ALLOWED = {"DOVECOTE_TEST_SILENCED_CHECKS": "dovecote.E001"}
LEASE = 2  # seconds: DOVECOTE_SEND_LEASE_SECONDS for the worker, so a dead one is noticed fast
NO_GRACE = override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0)


def crash_worker(
    process_env: dict[str, str], processes: list[Process], *, failpoint: str = "", name: str = "worker"
) -> Process:
    env = {**process_env, "DOVECOTE_SEND_LEASE_SECONDS": str(LEASE), **SHORT_SEND_LEASE_ALLOWED}
    if failpoint:
        env["DOVECOTE_FAILPOINTS"] = failpoint
    proc = start_worker(env, pool="solo", concurrency=1, name=name)
    processes.append(proc)
    return proc


def enqueue(bot, key: str, text: str = "Your order #1 is confirmed") -> OutboundMessage:
    message, created = outbound_message_enqueue(
        bot_id=bot.pk, chat_id=4242, payload={"text": text}, idempotency_key=key
    )
    assert created
    return message


def lease_expired(message: OutboundMessage) -> bool:
    message.refresh_from_db()
    return message.lease_expires_at is not None and message.lease_expires_at < timezone.now()


def assert_unknown_and_held(message: OutboundMessage, sandbox, bot, key: str) -> None:
    message.refresh_from_db()
    assert (message.state, message.attempts, message.idempotency_key) == (State.UNKNOWN, 1, key)
    assert len(sandbox.messages(token=bot.token)) == 1
    case = ReconciliationCase.objects.get(message=message)
    assert (case.status, case.idempotency_key) == (CaseStatus.OPEN, key)
    # Not resent: neither by another sweep nor by a redelivered task.
    with NO_GRACE:
        sweep()
    assert outbound_message_send(message.pk).status == "not-waiting"
    assert len(sandbox.calls(token=bot.token, method="sendMessage")) == 1


PRODUCER = """
import os, signal, django
django.setup()
from django.db import transaction
from outbox.services import outbound_message_enqueue
with transaction.atomic():
    outbound_message_enqueue(bot_id=int(os.environ["BOT_ID"]), chat_id=4242,
                             payload={"text": "Your order #1 is confirmed"}, idempotency_key="crash-a")
    if os.environ.get("DIE_BEFORE_COMMIT"):
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_producer_killed_before_its_commit_leaves_nothing_and_its_retry_sends_once(
    process_env: dict[str, str], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    env = {**process_env, "BOT_ID": str(bot.pk)}
    died = subprocess.run(
        [sys.executable, "-c", PRODUCER], cwd=ROOT, env={**env, "DIE_BEFORE_COMMIT": "1"}, check=False, timeout=60
    )
    assert died.returncode == -9
    assert not OutboundMessage.objects.filter(bot=bot).exists()
    assert sandbox.calls(token=bot.token) == []

    # The producer runs again with the same key (its own request is retried) and commits.
    subprocess.run([sys.executable, "-c", PRODUCER], cwd=ROOT, env=env, check=True, timeout=60)
    message = OutboundMessage.objects.get(bot=bot)
    assert outbound_message_send(message.pk).status == "sent"
    message.refresh_from_db()
    assert (message.state, message.attempts, message.idempotency_key) == (State.SENT, 1, "crash-a")
    assert sandbox.sent_texts(token=bot.token) == ["Your order #1 is confirmed"]


def test_a_worker_killed_after_the_claim_and_before_the_send_is_recovered_and_sends_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = crash_worker(process_env, processes, failpoint="after_claim", name="worker-b")
    message = enqueue(bot, "crash-b")
    wait_until(lambda: not doomed.alive(), message="the worker killed itself after the claim")
    message.refresh_from_db()
    assert (message.state, message.attempts) == (State.SENDING, 0)
    assert sandbox.calls(token=bot.token) == []

    survivor = crash_worker(process_env, processes, name="worker-b2")
    wait_until(lambda: lease_expired(message), timeout=LEASE + 5)
    assert sweep()["messages_released"] == 1
    wait_until(lambda: OutboundMessage.objects.filter(pk=message.pk, state=State.SENT).exists(), timeout=20)

    message.refresh_from_db()
    assert (message.state, message.attempts, message.idempotency_key) == (State.SENT, 1, "crash-b")
    assert sandbox.sent_texts(token=bot.token) == ["Your order #1 is confirmed"]

    # A replay of the finished event does nothing: a redelivered task, the same key again.
    assert dispatch(message.pk)
    again, created = outbound_message_enqueue(
        bot_id=bot.pk, chat_id=4242, payload={"text": "Your order #1 is confirmed"}, idempotency_key="crash-b"
    )
    assert (again.pk, created) == (message.pk, False)
    wait_until(lambda: "'not-waiting'" in survivor.log(), timeout=10, message="the replayed task ran")
    message.refresh_from_db()
    assert (message.state, message.attempts) == (State.SENT, 1)
    assert len(sandbox.calls(token=bot.token, method="sendMessage")) == 1


def test_a_worker_killed_while_telegram_holds_the_answer_leaves_an_unknown_message_and_a_case(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    sandbox.fault("slow", delay=3, count=1)  # Telegram has the message; its answer is on the way
    worker = crash_worker(process_env, processes, name="worker-c")
    message = enqueue(bot, "crash-c")
    sandbox.wait_for_calls(1, token=bot.token, method="sendMessage")
    worker.kill()

    message.refresh_from_db()
    assert (message.state, message.attempts) == (State.SENDING, 1)
    wait_until(lambda: lease_expired(message), timeout=LEASE + 5)
    assert sweep()["messages_unknown"] == 1
    assert_unknown_and_held(message, sandbox, bot, "crash-c")


def test_a_worker_killed_after_the_answer_and_before_recording_it_leaves_an_unknown_message_and_a_case(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = crash_worker(process_env, processes, failpoint="after_response", name="worker-d")
    message = enqueue(bot, "crash-d")
    wait_until(lambda: not doomed.alive(), message="the worker killed itself after the answer")

    message.refresh_from_db()
    assert (message.state, message.attempts) == (State.SENDING, 1)
    assert message.attempt_set.get().finished_at is None
    wait_until(lambda: lease_expired(message), timeout=LEASE + 5)
    assert sweep()["messages_unknown"] == 1
    assert_unknown_and_held(message, sandbox, bot, "crash-d")


def test_a_worker_restarted_during_a_backoff_wait_keeps_the_schedule_and_the_key(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    sandbox.fault("429", retry_after=3, count=1)
    worker = crash_worker(process_env, processes, name="worker-e")
    message = enqueue(bot, "crash-e")
    wait_until(lambda: OutboundMessage.objects.filter(pk=message.pk, state=State.RETRY).exists(), timeout=15)
    # The retry's countdown task is published and then fetched by this worker, which holds
    # it until its ETA; kill only once it is held, so that it dies with the worker (killed
    # earlier, the task would still sit in the queue and the next worker would simply run it).
    # The first try went out through the bot's drain task, so this is the first one-message task.
    assert "outbox.drain_bot[" in worker.log()
    wait_until(
        lambda: "outbox.send_outbound_message[" in worker.log(),
        timeout=10,
        message="the worker holding the retry's countdown task",
    )
    worker.kill()
    message.refresh_from_db()
    scheduled = message.next_attempt_at

    restarted = crash_worker(process_env, processes, name="worker-e2")
    assert restarted.alive()
    message.refresh_from_db()
    assert (message.state, message.next_attempt_at, message.idempotency_key) == (State.RETRY, scheduled, "crash-e")
    wait_until(lambda: timezone.now() > scheduled, timeout=5)
    time.sleep(0.1)
    with NO_GRACE:
        assert sweep()["messages_redispatched"] == 1

        # The bot's drain died with the worker too; its wake-up key expires within seconds,
        # and a later sweep (beat runs it every tick) wakes a new one.
        def sent_after_a_sweep() -> bool:
            sweep()
            return OutboundMessage.objects.filter(pk=message.pk, state=State.SENT).exists()

        wait_until(sent_after_a_sweep, timeout=30, interval=1.0)

    message.refresh_from_db()
    assert (message.attempts, message.idempotency_key) == (2, "crash-e")
    assert sandbox.sent_texts(token=bot.token) == ["Your order #1 is confirmed"]
    assert [a.outcome for a in message.attempt_set.all()] == ["rate_limited", "ok"]


def test_beat_runs_the_sweeper_scheduled_by_the_migration(
    process_env: dict[str, str], processes: list[Process], bot_factory
) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    # transactional tests flush the tables, so apply the data migration's own step again.
    migration = importlib.import_module("reconciliation.migrations.0002_sweeper_schedule")
    migration.schedule(django_apps, None)
    task = PeriodicTask.objects.get(task="reconciliation.sweep")
    assert task.enabled
    # Tick every second here, rather than the configured interval.
    task.interval = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    task.save()
    bot = bot_factory()
    stuck, _ = outbound_message_enqueue(bot_id=bot.pk, chat_id=1, payload={"text": "x"}, idempotency_key="beat")
    OutboundMessage.objects.filter(pk=stuck.pk).update(
        state=State.SENDING, lease_owner="dead:1", lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    celery = os.path.join(os.path.dirname(sys.executable), "celery")
    scheduler = "django_celery_beat.schedulers:DatabaseScheduler"
    beat = Process("beat", [celery, "-A", "project", "beat", "-l", "info", "--scheduler", scheduler], process_env)
    processes.append(beat)
    crash_worker(process_env, processes, name="worker-beat")
    wait_until(
        lambda: OutboundMessage.objects.get(pk=stuck.pk).state != State.SENDING,
        timeout=30,
        message=f"beat to run the sweeper:\n{beat.log()}",
    )


def _enqueue_batch(bot, prefix: str, n: int = 4) -> list[OutboundMessage]:
    # One commit, so one drain claims them all in one batch.
    with transaction.atomic():
        return [
            outbound_message_enqueue(
                bot_id=bot.pk, chat_id=5000 + i, payload={"text": f"{prefix} {i}"}, idempotency_key=f"{prefix}-{i}"
            )[0]
            for i in range(n)
        ]


@pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
def test_a_drain_killed_after_claiming_a_batch_is_recovered_and_each_message_sent_once(
    broker: str, process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = crash_worker(process_env, processes, failpoint="after_claim", name="worker-f")
    messages = _enqueue_batch(bot, "batch-f")
    wait_until(lambda: not doomed.alive(), message="the worker killed itself after claiming the batch")
    rows = OutboundMessage.objects.filter(pk__in=[m.pk for m in messages])
    assert {(m.state, m.attempts) for m in rows} == {(State.SENDING, 0)}
    assert sandbox.calls(token=bot.token) == []

    crash_worker(process_env, processes, name="worker-f2")
    wait_until(lambda: all(lease_expired(m) for m in messages), timeout=LEASE + 5)
    assert sweep()["messages_released"] == 4
    wait_until(lambda: rows.filter(state=State.SENT).count() == 4, timeout=20)

    assert {m.attempts for m in rows.all()} == {1}
    assert sorted(sandbox.sent_texts(token=bot.token)) == [f"batch-f {i}" for i in range(4)]


def test_a_drain_killed_after_its_batch_was_answered_leaves_every_started_send_unknown_and_resends_none(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = crash_worker(process_env, processes, failpoint="after_response", name="worker-g")
    messages = _enqueue_batch(bot, "batch-g")
    wait_until(lambda: not doomed.alive(), message="the worker killed itself after the answers")
    answered = len(sandbox.calls(token=bot.token, method="sendMessage"))
    assert 1 <= answered <= 4  # at least the first answer was in; the rest may have been on the wire

    # The batch goes out at the bot's rate-limit slots (about 33 ms apart at 30/s): when the
    # first answer came back, the later messages may not have started their request yet.
    # Whatever had started is ambiguous; whatever had not is merely claimed.
    rows = OutboundMessage.objects.filter(pk__in=[m.pk for m in messages])
    started = {m.pk for m in rows if m.attempts == 1}
    assert {(m.state, m.attempts) for m in rows} <= {(State.SENDING, 1), (State.SENDING, 0)}
    assert answered <= len(started)
    wait_until(lambda: all(lease_expired(m) for m in messages), timeout=LEASE + 5)
    report = sweep()
    assert (report["messages_unknown"], report["messages_released"]) == (len(started), 4 - len(started))
    assert {m.pk for m in rows.filter(state=State.UNKNOWN)} == started
    assert ReconciliationCase.objects.filter(message__in=rows, status=CaseStatus.OPEN).count() == len(started)

    # Those that never went out are sent once by a new worker; the unknown ones are not resent.
    crash_worker(process_env, processes, name="worker-g2")
    with NO_GRACE:
        wait_until(lambda: rows.filter(state=State.SENT).count() == 4 - len(started), timeout=20)
        sweep()
    time.sleep(0.5)
    texts = sandbox.sent_texts(token=bot.token, delivered=None)
    for message in rows:
        # Started ones reached Telegram at most once (never resent); the others exactly once.
        expected = {0, 1} if message.pk in started else {1}
        assert texts.count(message.payload["text"]) in expected


def test_a_router_killed_after_its_inline_runs_leaves_them_to_the_sweeper_and_the_reply_goes_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    from bots.inbox import inbox_update_store
    from bots.models import ConsumerRun, RunState
    from bots.routing import inbox_router_wake
    from tests.bots.fakes import message_update

    bot = bot_factory(responder="echo")
    env = {
        **process_env,
        "DOVECOTE_CONSUMER_LEASE_SECONDS": str(LEASE),
        "DOVECOTE_SEND_LEASE_SECONDS": str(LEASE),
        **SHORT_SEND_LEASE_ALLOWED,
    }
    doomed = crash_worker(env, processes, failpoint="after_inline_runs", name="router-a")
    update, _ = inbox_update_store(bot=bot, payload=message_update(chat_id=4343, text="ping", message_id=1))
    inbox_router_wake(bot.pk, update.pk)
    wait_until(lambda: not doomed.alive(), message="the router killed itself after its inline runs")
    runs = ConsumerRun.objects.filter(update=update)
    assert {(r.consumer, r.state, r.attempts) for r in runs} == {
        ("auto_reply", RunState.RUNNING, 1),
        ("analytics", RunState.RUNNING, 1),
    }
    # The reply was written claimed by the router that was to send it (outbox.transitions.
    # write_claimed): under its lease, with no attempt row, so it was never sent.
    reply = OutboundMessage.objects.get(bot=bot)
    assert (reply.state, reply.attempts) == (State.SENDING, 0)
    assert not reply.attempt_set.exists()
    assert sandbox.calls(token=bot.token, method="sendMessage") == []

    crash_worker(env, processes, name="router-a2")
    wait_until(lambda: all(r.lease_expires_at < timezone.now() for r in runs.all()), timeout=LEASE + 5)
    wait_until(lambda: OutboundMessage.objects.get(pk=reply.pk).lease_expires_at < timezone.now(), timeout=LEASE + 5)
    with NO_GRACE:
        report = sweep()
    assert report["runs_released"] == 2
    assert report["messages_released"] == 1  # no attempt: back to waiting, safe to send
    wait_until(lambda: runs.filter(state=RunState.DONE).count() == 2, timeout=30, message="the runs re-ran")
    wait_until(lambda: OutboundMessage.objects.filter(bot=bot, state=State.SENT).exists(), timeout=30)

    # The re-run found its reply by its key: one message, sent once.
    assert OutboundMessage.objects.filter(bot=bot).count() == 1
    assert sandbox.sent_texts(token=bot.token) == ["Echo: ping"]
    assert {(r.consumer, r.attempts) for r in runs.all()} == {("auto_reply", 2), ("analytics", 2)}
