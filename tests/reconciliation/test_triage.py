"""Operator triage services: Retry checks the stored key and the current state before it
requeues with the same key; edit-and-retry keeps history; bulk retry releases in batches."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.utils import timezone

from bots.models import ConsumerRun, RunState
from outbox.models import Circuit, CircuitState, DeadLetter, DeadLetterStatus, Effect, EffectState, ErrorClass, State
from reconciliation import triage
from reconciliation.models import AuditEntry, BulkRetry, BulkState, PayloadVersion
from reconciliation.sweeper import sweep
from tests.reconciliation.factories import message_row
from tests.reconciliation.triage_helpers import failed_by_sandbox, failed_row, failed_run, message_of, persona, send_now
from tests.support import queued


@pytest.fixture
def alice(db: None):
    return persona("alice", "Operator")


def test_retry_requeues_with_the_same_key_and_the_message_is_then_sent(sandbox, bot, alice) -> None:
    letter = failed_by_sandbox(sandbox, bot, text="Your order is ready")
    key = message_of(letter).idempotency_key

    result = triage.dead_letter_retry(letter, alice, "user unblocked the bot")

    assert result.outcome == triage.REQUEUED
    message = message_of(letter)
    assert message.state == State.RETRY
    assert message.idempotency_key == key
    letter.refresh_from_db()
    assert letter.status == DeadLetterStatus.REQUEUED
    assert send_now(message.pk) == "sent"
    assert sandbox.sent_texts(token=bot.token) == ["Your order is ready"]
    assert message_of(letter).idempotency_key == key
    entry = AuditEntry.objects.get(action="deadletter.retry")
    assert (entry.actor, entry.reason) == (alice, "user unblocked the bot")
    assert entry.target == f"outbox.DeadLetter:{letter.pk}"
    assert entry.outcome.startswith("requeued")


def test_retry_is_refused_when_the_ledger_shows_the_key_delivered(sandbox, bot, alice) -> None:
    letter = failed_by_sandbox(sandbox, bot)
    Effect.objects.create(key=letter.idempotency_key, state=EffectState.DONE, done_at=timezone.now())

    result = triage.dead_letter_retry(letter, alice, "try again")

    assert result.outcome == triage.REFUSED
    assert "ledger" in result.reason
    assert message_of(letter).state == State.FAILED
    assert DeadLetter.objects.get(pk=letter.pk).status == DeadLetterStatus.OPEN
    assert AuditEntry.objects.get(action="deadletter.retry").outcome.startswith("refused")
    assert len(sandbox.calls(token=bot.token, method="sendMessage")) == 1  # the first, refused, request
    assert sandbox.sent_texts(token=bot.token) == []


def test_retry_is_refused_when_the_message_was_delivered_meanwhile(bot, alice) -> None:
    letter = failed_row(bot)
    message = message_of(letter)
    type(message).objects.filter(pk=message.pk).update(state=State.SENT, sent_at=timezone.now(), telegram_message_id=77)

    result = triage.dead_letter_retry(letter, alice, "try again")

    assert result.outcome == triage.REFUSED
    assert "already delivered" in result.reason
    assert "77" in result.reason


def test_retry_of_one_bots_message_is_not_refused_because_another_bot_sent_the_same_key(
    sandbox, bot_factory, alice
) -> None:
    shop, support = bot_factory(), bot_factory()
    # Keys are unique per bot: each bot's producer may choose "order:1" for its own message.
    message_row(shop, key="order:1", state=State.SENT, telegram_message_id=501)
    letter = failed_by_sandbox(sandbox, support, text="Your ticket is open", key="order:1")

    result = triage.dead_letter_retry(letter, alice, "user unblocked the bot")

    assert result.outcome == triage.REQUEUED, result.reason
    assert send_now(letter.message_id) == "sent"
    assert sandbox.sent_texts(token=support.token) == ["Your ticket is open"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"state": State.CANCELLED, "cancel_reason": "order cancelled"}, "cancelled"),
        ({"expires_at": timezone.now() - timedelta(minutes=1)}, "expired"),
    ],
)
def test_retry_skips_stale_messages(bot, alice, change, expected) -> None:
    letter = failed_row(bot)
    type(message_of(letter)).objects.filter(pk=letter.message_id).update(**change)

    result = triage.dead_letter_retry(letter, alice, "try again")

    assert result.outcome == triage.SKIPPED
    assert expected in result.reason


def test_retry_skips_a_dead_letter_handled_by_hand(bot, alice) -> None:
    letter = failed_row(bot)
    assert triage.dead_letter_resolve(letter, alice, "sent the invoice by e-mail")

    result = triage.dead_letter_retry(letter, alice, "try again")

    assert result.outcome == triage.SKIPPED
    assert "handled by hand" in result.reason
    assert message_of(letter).state == State.FAILED


def veto_everything(message) -> str:
    return "the reminder is for a meeting that already happened"


def test_retry_skips_what_the_relevance_hook_vetoes(bot, alice, settings) -> None:
    settings.DOVECOTE_RELEVANCE_CHECK = "tests.reconciliation.test_triage.veto_everything"
    letter = failed_row(bot)

    result = triage.dead_letter_retry(letter, alice, "try again")

    assert result.outcome == triage.SKIPPED
    assert "meeting that already happened" in result.reason


def test_retry_needs_a_reason(bot, alice) -> None:
    letter = failed_row(bot)
    with pytest.raises(triage.TriageError):
        triage.dead_letter_retry(letter, alice, "  ")
    assert message_of(letter).state == State.FAILED


def test_edit_and_retry_keeps_the_original_and_records_who_and_why(sandbox, bot, alice) -> None:
    letter = failed_by_sandbox(sandbox, bot, text="Helo <b>world")
    corrected = {"text": "Hello world"}

    result = triage.dead_letter_retry(letter, alice, "fixed the typo", corrected_payload=corrected)

    assert result.requeued
    versions = list(PayloadVersion.objects.filter(message_id=letter.message_id).order_by("number"))
    assert [(v.number, v.payload, v.author, v.reason) for v in versions] == [
        (1, {"text": "Helo <b>world"}, None, "original"),
        (2, corrected, alice, "fixed the typo"),
    ]
    assert send_now(letter.message_id) == "sent"
    assert sandbox.sent_texts(token=bot.token) == ["Hello world"]


def test_edit_and_retry_refuses_a_payload_the_outbox_would_refuse(bot, alice) -> None:
    letter = failed_row(bot)
    with pytest.raises(triage.TriageError, match="refused"):
        triage.dead_letter_retry(letter, alice, "fix", corrected_payload={"text": ""})
    assert not PayloadVersion.objects.exists()


def test_a_failed_consumer_run_is_requeued_with_its_key(bot, alice) -> None:
    letter = failed_run(bot)

    result = triage.dead_letter_retry(letter, alice, "CRM is back")

    assert result.requeued, result
    assert ConsumerRun.objects.get(pk=letter.consumer_run_id).state == RunState.RETRY


def test_a_consumer_run_whose_effects_are_done_is_refused(bot, alice) -> None:
    letter = failed_run(bot)
    run = ConsumerRun.objects.select_related("update").get(pk=letter.consumer_run_id)
    Effect.objects.create(key=f"{triage.effect_prefix(run)}crm_post", state=EffectState.DONE)

    result = triage.dead_letter_retry(letter, alice, "CRM is back")

    assert result.outcome == triage.REFUSED
    assert ConsumerRun.objects.get(pk=run.pk).state == RunState.FAILED


def test_bulk_retry_releases_a_small_first_batch_then_doubles_within_the_rate_limit(bot, alice) -> None:
    letters = [failed_row(bot) for _ in range(45)]
    # One of them was delivered meanwhile: it is refused, not resent.
    delivered = message_of(letters[3])
    type(delivered).objects.filter(pk=delivered.pk).update(state=State.SENT, sent_at=timezone.now())

    bulk = triage.bulk_retry_start(DeadLetter.objects.filter(pk__in=[x.pk for x in letters]), alice, "502s are over")
    assert (bulk.total, bulk.first_batch, bulk.max_batch, bulk.state) == (45, 10, 30, BulkState.RUNNING)

    def waiting() -> int:
        return type(delivered).objects.filter(bot=bot, state=State.RETRY).count()

    assert triage.bulk_retry_tick(bulk.pk) == 1.0
    assert waiting() == 9  # ten checked, one refused
    assert triage.bulk_retry_tick(bulk.pk) == 1.0
    assert waiting() == 29
    assert triage.bulk_retry_tick(bulk.pk) is None  # 15 left, the cap is 30
    bulk.refresh_from_db()
    assert bulk.batches == [10, 20, 15]
    assert (bulk.requeued, bulk.refused, bulk.skipped, bulk.state) == (44, 1, 0, BulkState.DONE)
    assert bulk.reasons == {"refused: already delivered": 1}
    assert AuditEntry.objects.filter(action="deadletter.bulk_retry_item").count() == 45
    assert AuditEntry.objects.filter(action="deadletter.bulk_retry_done").count() == 1


def test_bulk_batches_are_capped_by_the_slowest_bots_rate_limit(bot_factory, alice) -> None:
    slow = bot_factory(rate_limit=4)
    letters = [failed_row(slow) for _ in range(12)]

    bulk = triage.bulk_retry_start([x.pk for x in letters], alice, "recovered")

    assert (bulk.first_batch, bulk.max_batch) == (4, 4)
    triage.bulk_retry_tick(bulk.pk)
    triage.bulk_retry_tick(bulk.pk)
    assert BulkRetry.objects.get(pk=bulk.pk).batches == [4, 4]


def test_a_cancelled_bulk_retry_releases_nothing_more(bot, alice) -> None:
    letters = [failed_row(bot) for _ in range(25)]
    bulk = triage.bulk_retry_start([x.pk for x in letters], alice, "recovered")
    triage.bulk_retry_tick(bulk.pk)

    assert triage.bulk_retry_cancel(bulk, alice, "wrong selection")
    assert triage.bulk_retry_tick(bulk.pk) is None

    bulk.refresh_from_db()
    assert (bulk.state, bulk.released, bulk.requeued) == (BulkState.CANCELLED, 10, 10)
    assert DeadLetter.objects.filter(status=DeadLetterStatus.OPEN).count() == 15
    assert AuditEntry.objects.filter(action="deadletter.bulk_retry_cancel", actor=alice).exists()


def test_a_second_chain_of_ticks_for_the_same_cursor_releases_nothing(bot, alice) -> None:
    letters = [failed_row(bot) for _ in range(45)]
    bulk = triage.bulk_retry_start([x.pk for x in letters], alice, "recovered")

    assert triage.bulk_retry_tick(bulk.pk, expect_released=0) == 1.0  # the planned tick
    # The sweeper's resume (or a lost tick turning up late) for the same cursor: it stops.
    assert triage.bulk_retry_tick(bulk.pk, expect_released=0) is None
    bulk.refresh_from_db()
    assert (bulk.released, bulk.batches) == (10, [10])
    assert triage.bulk_retry_tick(bulk.pk, expect_released=10) == 1.0


def test_the_sweeper_resumes_a_bulk_retry_whose_next_tick_was_lost(bot, alice, settings) -> None:
    settings.DOVECOTE_REDISPATCH_GRACE_SECONDS = 0
    letters = [failed_row(bot) for _ in range(25)]
    bulk = triage.bulk_retry_start([x.pk for x in letters], alice, "recovered")
    triage.bulk_retry_tick(bulk.pk)
    queue = f"{settings.DOVECOTE_REDIS_PREFIX}{settings.CELERY_TASK_QUEUE_BULK}"
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(queue)  # the next tick's broker message is lost
    # A tick that is only slow is left alone ...
    assert sweep()["bulk_retries_resumed"] == 0
    # ... one overdue by three ticks and the grace is resumed, for the cursor where it stopped.
    BulkRetry.objects.filter(pk=bulk.pk).update(ticked_at=timezone.now() - timedelta(seconds=5))

    assert sweep()["bulk_retries_resumed"] == 1

    [tick] = [t for t in queued(settings.CELERY_TASK_QUEUE_BULK) if t.name == "reconciliation.bulk_retry_tick"]
    assert (tick.args, tick.kwargs) == ([bulk.pk], {"released": 10})


def test_recover_since_takes_only_the_chosen_bot_reason_and_time(bot_factory, alice) -> None:
    bot, other = bot_factory(), bot_factory()
    old = failed_row(bot)
    DeadLetter.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(hours=3))
    wanted = [failed_row(bot) for _ in range(3)]
    failed_row(bot, reason_class=ErrorClass.PERMANENT)
    failed_row(other)

    bulk = triage.recover_since(
        user=alice,
        reason="gateway fixed",
        since=timezone.now() - timedelta(hours=1),
        reason_class=ErrorClass.EXHAUSTED,
        bot_id=bot.pk,
    )

    assert sorted(bulk.item_ids) == sorted(x.pk for x in wanted)
    assert "recover since" in bulk.scope


def test_resolve_discard_and_assign_are_audited(bot, alice) -> None:
    bob = persona("bob", "Operator")
    first, second = failed_row(bot), failed_row(bot)

    triage.dead_letter_assign(first, alice, bob)
    assert triage.dead_letter_resolve(first, alice, "customer called, handled by phone")
    assert triage.dead_letter_discard(second, alice, "test data")
    assert not triage.dead_letter_discard(second, alice, "again")

    first.refresh_from_db()
    assert (first.owner, first.status) == (bob, DeadLetterStatus.RESOLVED)
    assert DeadLetter.objects.get(pk=second.pk).status == DeadLetterStatus.DISCARDED
    actions = list(AuditEntry.objects.order_by("pk").values_list("action", "outcome"))
    assert actions == [
        ("deadletter.assign", "owner - -> bob"),
        ("deadletter.resolve", "resolved"),
        ("deadletter.discard", "discarded"),
        ("deadletter.discard", "not open: nothing changed"),
    ]


def test_pause_and_resume_a_bot_open_and_close_its_circuit_by_hand(bot, alice) -> None:
    scope = f"bot:{bot.pk}"
    triage.circuit_pause(scope, alice, "Telegram incident")
    circuit = Circuit.objects.get(scope=scope)
    assert (circuit.state, circuit.manual) == (CircuitState.OPEN, True)

    triage.circuit_resume(scope, alice, "incident over")
    assert Circuit.objects.get(scope=scope).state == CircuitState.CLOSED
    assert list(AuditEntry.objects.order_by("pk").values_list("action", flat=True)) == [
        "circuit.pause",
        "circuit.resume",
    ]


@pytest.mark.e2e
def test_a_real_worker_releases_a_bulk_retry_from_the_bulk_queue_and_each_message_is_sent_once(
    worker, sandbox, bot_factory
) -> None:
    from tests.support import wait_until

    bot = bot_factory()
    alice = persona("alice", "Operator")
    letters = [failed_row(bot, chat_id=8000 + i) for i in range(15)]

    bulk = triage.bulk_retry_start([x.pk for x in letters], alice, "gateway fixed")

    wait_until(lambda: len(sandbox.sent_texts(token=bot.token)) == 15, timeout=30, message="15 resends")
    bulk.refresh_from_db()
    assert (bulk.state, bulk.batches, bulk.requeued) == (BulkState.DONE, [10, 5], 15)
    for i in range(15):
        assert sandbox.sent_texts(token=bot.token, chat_id=8000 + i) == ["hello"]
