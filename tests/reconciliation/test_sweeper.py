"""The sweeper: returns what dead workers held, sends ambiguous sends to a case, cancels
stale work with a reason, prunes old ledger rows, and is safe to run twice at once."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.test import override_settings
from django.utils import timezone

from bots import transitions as bot_transitions
from bots.models import ConsumerRun, InboundUpdate, RunState, UpdateState
from outbox.models import Attempt, DeadLetter, Effect, EffectState, ErrorClass, OutboundMessage, State
from reconciliation.models import CaseStatus, ReconciliationCase, SweeperLease
from reconciliation.sweeper import lease_take, sweep
from tests.reconciliation.factories import message_row, open_attempt, stored_update
from tests.support import METRICS_AUTH

NO_GRACE = {"DOVECOTE_REDISPATCH_GRACE_SECONDS": 0}


@pytest.fixture(autouse=True)
def _retention_every_sweep(settings) -> None:
    settings.DOVECOTE_RETENTION_INTERVAL_SECONDS = 0


def test_a_claim_whose_worker_died_before_the_request_is_released_and_redispatched(bot) -> None:
    message = message_row(bot, state=State.SENDING)

    report = sweep()

    message.refresh_from_db()
    assert report["messages_released"] == 1
    assert (message.state, message.attempts, message.lease_owner) == (State.PENDING, 0, "")
    assert message.idempotency_key == "k-1"


def test_a_send_whose_worker_died_after_the_request_started_becomes_unknown_with_a_case(bot) -> None:
    message = message_row(bot, state=State.SENDING)
    open_attempt(message)

    report = sweep()
    again = sweep()

    message.refresh_from_db()
    assert (report["messages_unknown"], again["messages_unknown"]) == (1, 0)
    assert (message.state, message.attempts, message.last_error_class) == (State.UNKNOWN, 1, ErrorClass.AMBIGUOUS)
    assert message.attempt_set.get().finished_at is not None
    assert ReconciliationCase.objects.get(message=message).status == CaseStatus.OPEN


def test_a_live_lease_is_left_alone(bot) -> None:
    message = message_row(bot, state=State.SENDING, lease_expires_at=timezone.now() + timedelta(seconds=30))
    sweep()
    message.refresh_from_db()
    assert message.state == State.SENDING


def test_a_due_message_whose_broker_message_was_lost_is_redispatched(bot) -> None:
    message = message_row(bot, next_attempt_at=timezone.now() - timedelta(seconds=5))
    with override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=30):
        assert sweep()["messages_redispatched"] == 0  # its task may still be on its way
    with override_settings(**NO_GRACE):
        assert sweep()["messages_redispatched"] == 1
    message.refresh_from_db()
    assert message.state == State.PENDING


def test_a_message_past_its_expiry_is_cancelled_with_a_reason(bot) -> None:
    message = message_row(bot, state=State.RETRY, expires_at=timezone.now() - timedelta(seconds=1))
    assert sweep()["messages_expired"] == 1
    message.refresh_from_db()
    assert (message.state, message.last_error_class) == (State.CANCELLED, ErrorClass.EXPIRED)
    assert "expired" in message.cancel_reason


def test_a_consumer_run_whose_worker_died_is_retried(bot) -> None:
    update = stored_update(bot)
    run = ConsumerRun.objects.create(
        update=update,
        bot=bot,
        consumer="auto_reply",
        state=RunState.RUNNING,
        attempts=1,
        next_attempt_at=timezone.now(),
        lease_owner="dead:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        trace_id=update.trace_id,
    )
    assert sweep()["runs_released"] == 1
    run.refresh_from_db()
    assert (run.state, run.lease_owner) == (RunState.RETRY, "")


def _lose_the_worker(run: ConsumerRun) -> None:
    """A worker claims the run (as consumer_run_execute does) and dies or hangs: its lease runs out."""
    ConsumerRun.objects.filter(pk=run.pk).update(next_attempt_at=timezone.now())
    assert bot_transitions.claim_run(run.pk, worker="doomed:1", lease=timedelta(seconds=30))
    ConsumerRun.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def test_each_lost_worker_spends_an_attempt_and_the_last_one_sends_the_run_to_the_dead_letters(bot) -> None:
    update = stored_update(bot)
    run = ConsumerRun.objects.create(
        update=update,
        bot=bot,
        consumer="auto_reply",
        max_attempts=3,
        next_attempt_at=timezone.now(),
        trace_id=update.trace_id,
    )

    for attempt in (1, 2):
        _lose_the_worker(run)
        report = sweep()
        run.refresh_from_db()
        assert (report["runs_released"], report["runs_dead_lettered"]) == (1, 0)
        assert (run.state, run.attempts, run.last_error_class) == (RunState.RETRY, attempt, "transient")
        assert "lease" in run.last_error
        assert run.next_attempt_at > timezone.now()  # after the consumer's backoff, not at once
        assert not DeadLetter.objects.exists()

    _lose_the_worker(run)
    report = sweep()
    again = sweep()

    run.refresh_from_db()
    assert (report["runs_released"], report["runs_dead_lettered"]) == (0, 1)
    assert again["runs_dead_lettered"] == 0
    assert (run.state, run.attempts, run.last_error_class) == (RunState.FAILED, 3, "exhausted")
    assert run.finished_at is not None
    letter = DeadLetter.objects.get()
    assert (letter.consumer_run_id, letter.consumer, letter.reason_class) == (run.pk, "auto_reply", "exhausted")
    assert "lease" in letter.last_error
    assert letter.trace_id == update.trace_id


def test_a_lost_run_past_its_budget_is_never_cancelled_for_its_age(bot) -> None:
    update = stored_update(bot)
    InboundUpdate.objects.filter(pk=update.pk).update(received_at=timezone.now() - timedelta(days=2))
    run = ConsumerRun.objects.create(
        update=update,
        bot=bot,
        consumer="auto_reply",
        max_attempts=1,
        next_attempt_at=timezone.now(),
        trace_id=update.trace_id,
    )
    _lose_the_worker(run)

    report = sweep()

    run.refresh_from_db()
    assert (report["runs_dead_lettered"], report["runs_cancelled_too_old"]) == (1, 0)
    assert run.state == RunState.FAILED
    assert DeadLetter.objects.get(consumer_run=run).reason_class == "exhausted"


def test_a_failed_run_older_than_its_consumers_max_age_goes_to_the_dead_letters_not_cancelled(bot) -> None:
    update = stored_update(bot)
    InboundUpdate.objects.filter(pk=update.pk).update(received_at=timezone.now() - timedelta(days=2))
    run = ConsumerRun.objects.create(
        update=update,
        bot=bot,
        consumer="auto_reply",
        state=RunState.RETRY,
        attempts=2,
        next_attempt_at=timezone.now(),
        last_error="worker lost: still running when its lease ran out",
        last_error_class="transient",
        trace_id=update.trace_id,
    )

    report = sweep()

    run.refresh_from_db()
    assert (report["runs_dead_lettered_too_old"], report["runs_cancelled_too_old"]) == (1, 0)
    assert (run.state, run.last_error_class, run.cancel_reason) == (RunState.FAILED, "expired", "")
    letter = DeadLetter.objects.get(consumer_run=run)
    assert letter.reason_class == "expired"
    assert letter.first_error == "worker lost: still running when its lease ran out"
    assert "max age" in letter.last_error


def test_a_consumer_run_older_than_its_consumers_max_age_is_cancelled_not_run_late(bot) -> None:
    update = stored_update(bot)
    InboundUpdate.objects.filter(pk=update.pk).update(received_at=timezone.now() - timedelta(days=2))
    run = ConsumerRun.objects.create(
        update=update,
        bot=bot,
        consumer="auto_reply",
        state=RunState.RETRY,
        next_attempt_at=timezone.now(),
        trace_id=update.trace_id,
    )
    assert sweep()["runs_cancelled_too_old"] == 1
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED
    assert "max age" in run.cancel_reason


def test_an_unrouted_update_is_redispatched(bot) -> None:
    update = stored_update(bot)
    assert update.state == UpdateState.NEW
    with override_settings(**NO_GRACE):
        assert sweep()["updates_redispatched"] == 1


def _age(model, pk: int, field: str, days: float) -> None:
    model.objects.filter(pk=pk).update(**{field: timezone.now() - timedelta(days=days)})


def test_old_ledger_and_dedupe_rows_are_pruned_and_recent_or_open_ones_kept(bot) -> None:
    old_done = Effect.objects.create(key="eff:old:done", state=EffectState.DONE)
    old_unknown = Effect.objects.create(key="eff:old:unknown", state=EffectState.UNKNOWN)
    Effect.objects.create(key="eff:young:done", state=EffectState.DONE)
    for effect in (old_done, old_unknown):
        _age(Effect, effect.pk, "created_at", 8)
    old_update, old_failed_run_update, young_update = stored_update(bot), stored_update(bot), stored_update(bot)
    for update in (old_update, old_failed_run_update, young_update):
        InboundUpdate.objects.filter(pk=update.pk).update(state=UpdateState.DONE)
    ConsumerRun.objects.create(
        update=old_update,
        bot=bot,
        consumer="auto_reply",
        state=RunState.DONE,
        next_attempt_at=timezone.now(),
    )
    ConsumerRun.objects.create(
        update=old_failed_run_update,
        bot=bot,
        consumer="auto_reply",
        state=RunState.FAILED,
        next_attempt_at=timezone.now(),
    )
    for update in (old_update, old_failed_run_update):
        _age(InboundUpdate, update.pk, "received_at", 8)

    with override_settings(DOVECOTE_LEDGER_RETENTION_DAYS=7):
        report = sweep()

    assert (report["effects_pruned"], report["updates_pruned"]) == (1, 1)
    assert set(Effect.objects.values_list("key", flat=True)) == {"eff:old:unknown", "eff:young:done"}
    assert set(InboundUpdate.objects.values_list("pk", flat=True)) == {old_failed_run_update.pk, young_update.pk}


def test_old_sent_and_cancelled_messages_are_pruned_with_their_attempts_and_the_rest_kept(bot) -> None:
    old_sent = message_row(bot, key="old-sent", state=State.SENT)
    open_attempt(old_sent)
    old_cancelled = message_row(bot, key="old-cancelled", state=State.CANCELLED)
    old_failed = message_row(bot, key="old-failed", state=State.FAILED)
    old_sent_with_open_case = message_row(bot, key="old-sent-case", state=State.SENT)
    ReconciliationCase.objects.create(
        message=old_sent_with_open_case, idempotency_key="old-sent-case", status=CaseStatus.OPEN
    )
    young_sent = message_row(bot, key="young-sent", state=State.SENT)
    for message in (old_sent, old_cancelled, old_failed, old_sent_with_open_case):
        _age(OutboundMessage, message.pk, "updated_at", 91)
    _age(OutboundMessage, young_sent.pk, "updated_at", 89)

    with override_settings(DOVECOTE_OUTBOX_RETENTION_DAYS=90):
        report = sweep()

    assert report["messages_pruned"] == 2
    assert set(OutboundMessage.objects.values_list("idempotency_key", flat=True)) == {
        "old-failed",
        "old-sent-case",
        "young-sent",
    }
    assert not Attempt.objects.filter(message_id=old_sent.pk).exists()
    with override_settings(DOVECOTE_OUTBOX_RETENTION_DAYS=0):
        _age(OutboundMessage, young_sent.pk, "updated_at", 400)
        assert sweep()["messages_pruned"] == 0  # 0 keeps them


def test_dedupe_rows_are_kept_for_telegrams_24_hours_whatever_the_setting(bot) -> None:
    update = stored_update(bot)
    InboundUpdate.objects.filter(pk=update.pk).update(state=UpdateState.DONE)
    _age(InboundUpdate, update.pk, "received_at", 0.9)
    with override_settings(DOVECOTE_LEDGER_RETENTION_DAYS=0):
        assert sweep()["updates_pruned"] == 0
    _age(InboundUpdate, update.pk, "received_at", 1.1)
    with override_settings(DOVECOTE_LEDGER_RETENTION_DAYS=0):
        assert sweep()["updates_pruned"] == 1


@override_settings(DOVECOTE_RETENTION_INTERVAL_SECONDS=3600)
def test_retention_runs_once_per_interval_not_every_tick(bot) -> None:
    Effect.objects.create(key="eff:old:1", state=EffectState.DONE)
    _age(Effect, Effect.objects.get(key="eff:old:1").pk, "created_at", 8)
    assert sweep()["effects_pruned"] == 1
    Effect.objects.create(key="eff:old:2", state=EffectState.DONE)
    _age(Effect, Effect.objects.get(key="eff:old:2").pk, "created_at", 8)
    assert sweep()["effects_pruned"] == 0  # next hour


def test_a_second_sweeper_steps_aside_while_one_holds_the_lease(bot) -> None:
    message_row(bot, state=State.SENDING)
    assert lease_take("other-beat:1:abc")
    assert sweep() == {"skipped": 1}
    assert OutboundMessage.objects.get().state == State.SENDING
    SweeperLease.objects.update(holder="", expires_at=None)  # the other one finishes
    assert sweep()["messages_released"] == 1


def test_a_sweeper_killed_mid_sweep_blocks_the_next_one_only_until_its_lease_expires(bot, settings) -> None:
    message_row(bot, state=State.SENDING)
    settings.DOVECOTE_SWEEP_LEASE_SECONDS = 60
    assert lease_take("killed-beat:1:abc")  # and then the process dies: nobody frees it
    assert sweep() == {"skipped": 1}
    SweeperLease.objects.update(expires_at=timezone.now() - timedelta(seconds=1))  # a minute on
    assert sweep()["messages_released"] == 1
    assert SweeperLease.objects.get().holder == ""  # freed at the end, not left to expire


def test_the_sweeper_takes_no_advisory_lock_that_a_transaction_pooler_could_leak(bot) -> None:
    message_row(bot, state=State.SENDING)
    sweep()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
        assert cursor.fetchone()[0] == 0


@pytest.mark.django_db(transaction=True)
def test_two_sweepers_at_once_recover_each_row_exactly_once(bot_factory) -> None:
    bot = bot_factory()
    messages = [message_row(bot, key=f"k-{i}", state=State.SENDING) for i in range(40)]
    for message in messages[:20]:
        open_attempt(message)
    reports: list[dict] = []
    start = threading.Barrier(2)

    def run() -> None:
        try:
            start.wait()
            reports.append(sweep())
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sum(r.get("messages_unknown", 0) for r in reports) == 20
    assert sum(r.get("messages_released", 0) for r in reports) == 20
    assert ReconciliationCase.objects.count() == 20
    assert OutboundMessage.objects.filter(state=State.UNKNOWN).count() == 20
    assert all(m.attempt_set.count() <= 1 for m in OutboundMessage.objects.all())


def test_a_wait_longer_than_a_broker_countdown_is_published_ahead_with_its_exact_countdown(bot) -> None:
    """Found from outside: `send_at` and waits over 60 s were parked in the row and picked up
    by a sweep only after the redispatch grace, 30-45 s late."""
    from datetime import datetime

    from tests.support import queued

    now = timezone.now()
    # Scheduled 90 s ahead when it was written, 80 s ago: due in 10 s.
    due = now + timedelta(seconds=10)
    parked = message_row(bot, key="parked", send_at=due, next_attempt_at=due)
    OutboundMessage.objects.filter(pk=parked.pk).update(updated_at=now - timedelta(seconds=80))
    # A short backoff was published with its countdown when it was scheduled: not again.
    message_row(bot, key="short", state=State.RETRY, chat_id=1, next_attempt_at=now + timedelta(seconds=5))
    # Due after the next two ticks: the next sweeps publish it.
    later = message_row(bot, key="later", chat_id=2, next_attempt_at=now + timedelta(seconds=300))
    OutboundMessage.objects.filter(pk=later.pk).update(updated_at=now - timedelta(seconds=80))

    with override_settings(DOVECOTE_SWEEP_INTERVAL_SECONDS=15):
        report = sweep()

    assert report["messages_published_ahead"] == 1
    [task] = [t for t in queued() if t.name == "outbox.send_outbound_message"]
    assert task.args == [parked.pk]
    eta = datetime.fromisoformat(task.eta)
    assert abs((eta - (now + timedelta(seconds=10))).total_seconds()) < 1.0


def test_a_consumer_run_parked_past_a_broker_countdown_is_published_ahead(bot) -> None:
    from tests.support import queued

    update = stored_update(bot)
    now = timezone.now()
    run = ConsumerRun.objects.create(
        update=update, bot=bot, consumer="analytics", state=RunState.RETRY, next_attempt_at=now + timedelta(seconds=12)
    )
    ConsumerRun.objects.filter(pk=run.pk).update(updated_at=now - timedelta(seconds=200))

    report = sweep()

    assert report["runs_published_ahead"] == 1
    assert [t.args for t in queued() if t.name == "bots.run_consumer"] == [[run.pk]]


def test_readyz_and_metrics_say_when_the_sweeper_last_ran(client, db) -> None:
    before = client.get("/readyz").json()["sweeper"]
    sweep()
    after = client.get("/readyz").json()["sweeper"]

    assert before == {"last_run": None, "seconds_ago": None}
    assert 0 <= after["seconds_ago"] < 5
    metrics = client.get("/metrics", headers=METRICS_AUTH).content.decode()
    line = next(x for x in metrics.splitlines() if x.startswith("dovecote_sweeper_last_run_timestamp_seconds "))
    assert abs(float(line.split()[1]) - timezone.now().timestamp()) < 5
