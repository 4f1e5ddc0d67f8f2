"""Retention keeps up: one sweep prunes in batches until nothing old is left or its time
budget is spent (the next sweep then continues at once), every table has a retention, and
nothing an operator or a redelivery could still need is deleted."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from bots.inbox import inbox_update_store
from bots.models import ChatState, ConsumerRun, HandlerCall, InboundUpdate, RunState, UpdateState
from outbox.models import Attempt, DeadLetter, DeadLetterStatus, OutboundMessage, State
from reconciliation.models import (
    AuditEntry,
    BulkRetry,
    BulkState,
    CaseStatus,
    Decision,
    PayloadVersion,
    ReconciliationCase,
)
from reconciliation.sweeper import sweep
from tests.reconciliation.factories import message_row, stored_update
from tests.reconciliation.triage_helpers import failed_row, failed_run

# Everything that is not under test is kept, so each test sees only its own table move.
KEEP_ALL = {
    "DOVECOTE_RETENTION_INTERVAL_SECONDS": 0,
    "DOVECOTE_RETENTION_BUDGET_SECONDS": 60,
    "DOVECOTE_OUTBOX_RETENTION_DAYS": 90,
    "DOVECOTE_LEDGER_RETENTION_DAYS": 7,
    "DOVECOTE_PAYLOAD_RETENTION_DAYS": 30,
    "DOVECOTE_FAILED_RETENTION_DAYS": 180,
    "DOVECOTE_CASE_RETENTION_DAYS": 180,
    "DOVECOTE_CHAT_STATE_RETENTION_DAYS": 90,
    "DOVECOTE_PAYLOAD_VERSION_RETENTION_DAYS": 30,
    "DOVECOTE_BULK_RETRY_RETENTION_DAYS": 90,
    "DOVECOTE_AUDIT_RETENTION_DAYS": 0,
}


@pytest.fixture(autouse=True)
def _settings(settings) -> None:
    for name, value in KEEP_ALL.items():
        setattr(settings, name, value)


def _age(model, pks, field: str, days: float) -> None:
    pks = pks if isinstance(pks, list) else [pks]
    model.objects.filter(pk__in=pks).update(**{field: timezone.now() - timedelta(days=days)})


def old_sent_messages(bot, n: int, *, days: float = 91) -> None:
    """n sent messages last changed `days` ago (their text purged long since), each with one
    attempt, by INSERT ... SELECT."""
    template = message_row(bot, key="template", state=State.SENT)
    m = OutboundMessage._meta.db_table
    columns = [f.column for f in OutboundMessage._meta.concrete_fields if not f.primary_key]
    select = [
        {
            "idempotency_key": "'old-' || g",
            "updated_at": "%(at)s",
            "sent_at": "%(at)s",
            "payload_purged_at": "%(at)s",
        }.get(c, f'"{c}"')
        for c in columns
    ]
    at = timezone.now() - timedelta(days=days)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {m} ({', '.join(columns)}) SELECT {', '.join(select)} "
            f"FROM {m}, generate_series(1, %(n)s) AS g WHERE {m}.id = %(template)s",
            {"n": n, "at": at, "template": template.pk},
        )
        cursor.execute(
            f"INSERT INTO {Attempt._meta.db_table} (message_id, number, worker, started_at, finished_at, outcome, "
            "description) SELECT id, 1, 'w', %(at)s, %(at)s, 'ok', '' FROM "
            + m
            + " WHERE idempotency_key LIKE 'old-%%'",
            {"at": at},
        )
    template.delete()


def running(update: InboundUpdate) -> ConsumerRun:
    """A run a live worker holds right now (the sweeper leaves it alone)."""
    now = timezone.now()
    return ConsumerRun.objects.create(
        update=update,
        bot_id=update.bot_id,
        consumer="auto_reply",
        state=RunState.RUNNING,
        next_attempt_at=now,
        lease_owner="alive:1",
        lease_expires_at=now + timedelta(minutes=5),
    )


# --------------------------------------------------------------------------- keeping up
@override_settings(DOVECOTE_RETENTION_BATCH_SIZE=500)
def test_one_sweep_prunes_every_old_message_in_batches_not_just_a_thousand(bot) -> None:
    old_sent_messages(bot, 2500)
    young = message_row(bot, key="young", state=State.SENT)

    report = sweep()

    assert report["messages_pruned"] == 2500
    assert report["retention_unfinished"] == 0
    assert list(OutboundMessage.objects.values_list("pk", flat=True)) == [young.pk]
    assert not Attempt.objects.exists()


@override_settings(
    DOVECOTE_RETENTION_INTERVAL_SECONDS=3600, DOVECOTE_RETENTION_BUDGET_SECONDS=0, DOVECOTE_RETENTION_BATCH_SIZE=100
)
def test_a_spent_budget_stops_after_one_batch_and_the_next_sweep_continues_without_waiting(bot) -> None:
    old_sent_messages(bot, 250)

    reports = [sweep() for _ in range(4)]

    assert [r["messages_pruned"] for r in reports] == [100, 100, 50, 0]
    # The third pass ran out of budget before it looked at the other tables; the fourth
    # found nothing old left anywhere.
    assert [r["retention_unfinished"] for r in reports] == [1, 1, 1, 0]
    # A pass finished everything: the next waits for the interval.
    later = message_row(bot, key="later", state=State.SENT)
    _age(OutboundMessage, later.pk, "updated_at", 91)
    assert sweep()["messages_pruned"] == 0
    assert OutboundMessage.objects.filter(pk=later.pk).exists()


# --------------------------------------------------------------------------- failed and unknown messages
def test_failed_and_unknown_messages_go_after_their_retention_once_letter_and_case_are_closed(bot) -> None:
    long_ago = timezone.now() - timedelta(days=181)
    resolved = failed_row(bot)
    DeadLetter.objects.filter(pk=resolved.pk).update(status=DeadLetterStatus.RESOLVED, resolved_at=long_ago)
    still_open = failed_row(bot)
    too_young = failed_row(bot)
    DeadLetter.objects.filter(pk=too_young.pk).update(status=DeadLetterStatus.DISCARDED)
    decided = message_row(bot, key="unknown-decided", state=State.UNKNOWN)
    ReconciliationCase.objects.create(
        message=decided, idempotency_key=decided.idempotency_key, status=CaseStatus.RESOLVED, decided_at=long_ago
    )
    undecided = message_row(bot, key="unknown-open", state=State.UNKNOWN)
    ReconciliationCase.objects.create(message=undecided, idempotency_key=undecided.idempotency_key)
    recently_decided = message_row(bot, key="unknown-recent-case", state=State.UNKNOWN)
    ReconciliationCase.objects.create(
        message=recently_decided,
        idempotency_key=recently_decided.idempotency_key,
        status=CaseStatus.RESOLVED,
        decided_at=timezone.now() - timedelta(days=10),
    )
    olds = [resolved.message_id, still_open.message_id, decided.pk, undecided.pk, recently_decided.pk]
    _age(OutboundMessage, olds, "updated_at", 181)
    _age(OutboundMessage, too_young.message_id, "updated_at", 179)

    report = sweep()

    assert report["messages_pruned"] == 2
    kept = set(OutboundMessage.objects.values_list("pk", flat=True))
    assert kept == {still_open.message_id, too_young.message_id, undecided.pk, recently_decided.pk}
    # The open dead letter and case are untouched; the closed ones went with their messages.
    assert set(DeadLetter.objects.values_list("pk", flat=True)) == {still_open.pk, too_young.pk}
    assert ReconciliationCase.objects.filter(status=CaseStatus.OPEN).count() == 1


def test_a_sent_message_whose_update_may_still_run_again_keeps_its_key(bot) -> None:
    letter = failed_run(bot)  # the run's dead letter is open: an operator may retry it
    answer = message_row(bot, key="reply-to-failed-run", state=State.SENT, source_update=letter.consumer_run.update)
    other = message_row(bot, key="reply-to-nothing", state=State.SENT)
    _age(OutboundMessage, [answer.pk, other.pk], "updated_at", 400)

    assert sweep()["messages_pruned"] == 1
    assert OutboundMessage.objects.filter(pk=answer.pk).exists()


# --------------------------------------------------------------------------- inbound updates
def test_updates_whose_runs_failed_go_after_the_failed_retention_once_no_dead_letter_is_open(bot) -> None:
    closed, still_open, too_young = failed_run(bot), failed_run(bot), failed_run(bot)
    DeadLetter.objects.filter(pk__in=[closed.pk, too_young.pk]).update(status=DeadLetterStatus.RESOLVED)
    updates = {letter.pk: letter.consumer_run.update_id for letter in (closed, still_open, too_young)}
    InboundUpdate.objects.filter(pk__in=updates.values()).update(state=UpdateState.DONE)
    _age(InboundUpdate, [updates[closed.pk], updates[still_open.pk]], "received_at", 181)
    _age(InboundUpdate, updates[too_young.pk], "received_at", 179)

    report = sweep()

    assert report["updates_pruned"] == 1
    assert set(InboundUpdate.objects.values_list("pk", flat=True)) == {updates[still_open.pk], updates[too_young.pk]}
    assert not ConsumerRun.objects.filter(update_id=updates[closed.pk]).exists()
    assert set(DeadLetter.objects.values_list("pk", flat=True)) == {still_open.pk, too_young.pk}


def journaled(update: InboundUpdate, ordinal: int = 0) -> HandlerCall:
    """A python-telegram-bot handler's answered sendMessage (bots/ptb), its whole result kept."""
    return HandlerCall.objects.create(
        bot_id=update.bot_id,
        update=update,
        consumer="shop",
        ordinal=ordinal,
        method="sendMessage",
        target=f"chat_id={update.chat_id}",
        kind="outbox",
        ok=True,
        result={"message_id": 7, "text": "your order ships on Monday"},
        answered_at=timezone.now(),
    )


def test_handler_results_past_payload_retention_are_blanked_unless_their_update_may_run_again(bot) -> None:
    old, young, waiting = stored_update(bot), stored_update(bot), stored_update(bot)
    running(waiting)
    calls = {update.pk: journaled(update) for update in (old, young, waiting)}
    _age(HandlerCall, [calls[old.pk].pk, calls[waiting.pk].pk], "answered_at", 31)

    with override_settings(DOVECOTE_LEDGER_RETENTION_DAYS=60):
        assert sweep()["handler_results_purged"] == 1

    purged = HandlerCall.objects.get(pk=calls[old.pk].pk)
    assert (purged.result, purged.ok, purged.method) == (None, True, "sendMessage")
    assert purged.result_purged_at is not None
    assert HandlerCall.objects.get(pk=calls[young.pk].pk).result["text"] == "your order ships on Monday"
    assert HandlerCall.objects.get(pk=calls[waiting.pk].pk).result is not None  # a re-run replays it


def test_inbound_payloads_past_retention_are_cut_to_the_update_id_and_still_deduplicate(bot) -> None:
    old = stored_update(bot, text="my phone is +44 20 7946 0000")
    young = stored_update(bot, text="hello")
    waiting = stored_update(bot, text="still to answer")
    InboundUpdate.objects.filter(pk__in=[old.pk, young.pk, waiting.pk]).update(state=UpdateState.DONE)
    running(waiting)
    _age(InboundUpdate, [old.pk, waiting.pk], "received_at", 31)

    with override_settings(DOVECOTE_LEDGER_RETENTION_DAYS=60):
        assert sweep()["inbound_payloads_purged"] == 1

    old.refresh_from_db()
    assert old.payload == {"update_id": old.update_id}
    assert old.payload_purged_at is not None
    assert (old.chat_id, old.update_type, old.message_id) == (4242, "message", young.message_id - 2)
    assert old.text == ""
    assert InboundUpdate.objects.get(pk=young.pk).text == "hello"
    assert InboundUpdate.objects.get(pk=waiting.pk).text == "still to answer"
    # Telegram delivers the old update again: still a duplicate.
    again, created = inbox_update_store(bot=bot, payload={"update_id": old.update_id, "message": {"text": "x"}})
    assert (created, again.pk) == (False, old.pk)


# --------------------------------------------------------------------------- chat states
def test_a_chat_state_goes_only_when_its_chat_is_quiet_and_nothing_could_answer_it_again(bot) -> None:
    quiet, busy, live_run, dead_lettered = 1001, 1002, 1003, 1004
    for chat in (quiet, busy, live_run, dead_lettered):
        ChatState.objects.create(bot=bot, chat_id=chat, last_answered_message_id=10)
    old_update = stored_update(bot, chat_id=live_run)
    running(old_update)
    letter = failed_run(bot)
    InboundUpdate.objects.filter(pk=letter.consumer_run.update_id).update(chat_id=dead_lettered)
    _age(InboundUpdate, [old_update.pk, letter.consumer_run.update_id], "received_at", 91)
    stored_update(bot, chat_id=busy)  # a message today
    _age(ChatState, list(ChatState.objects.values_list("pk", flat=True)), "updated_at", 91)

    assert sweep()["chat_states_pruned"] == 1

    assert set(ChatState.objects.values_list("chat_id", flat=True)) == {busy, live_run, dead_lettered}


def test_chat_states_are_kept_for_ever_with_retention_0(bot) -> None:
    state = ChatState.objects.create(bot=bot, chat_id=77)
    _age(ChatState, state.pk, "updated_at", 1000)
    with override_settings(DOVECOTE_CHAT_STATE_RETENTION_DAYS=0):
        assert sweep()["chat_states_pruned"] == 0
    assert ChatState.objects.filter(pk=state.pk).exists()


# --------------------------------------------------------------------------- reconciliation's own
def test_payload_versions_go_after_their_retention_unless_their_message_is_still_open(bot) -> None:
    settled = message_row(bot, key="settled", state=State.SENT)
    letter = failed_row(bot)  # open dead letter: an operator may still compare versions
    recent = message_row(bot, key="recently-corrected", state=State.CANCELLED)
    for message in (settled, letter.message, recent):
        PayloadVersion.objects.create(message=message, number=1, payload={"text": "orig"}, reason="original")
        PayloadVersion.objects.create(message=message, number=2, payload={"text": "fixed"}, reason="typo")
    _age(PayloadVersion, list(PayloadVersion.objects.values_list("pk", flat=True)), "created_at", 31)
    PayloadVersion.objects.filter(message=recent, number=2).update(created_at=timezone.now())

    assert sweep()["payload_versions_pruned"] == 2

    assert set(PayloadVersion.objects.values_list("message_id", flat=True)) == {letter.message_id, recent.pk}
    assert PayloadVersion.objects.filter(message=recent).count() == 2  # a message's versions go together


def test_finished_bulk_retries_go_after_their_retention_and_running_ones_stay(bot) -> None:
    long_ago = timezone.now() - timedelta(days=91)
    done = BulkRetry.objects.create(reason="r", state=BulkState.DONE, finished_at=long_ago)
    cancelled = BulkRetry.objects.create(reason="r", state=BulkState.CANCELLED, finished_at=long_ago)
    running = BulkRetry.objects.create(reason="r", state=BulkState.RUNNING)
    recent = BulkRetry.objects.create(reason="r", state=BulkState.DONE, finished_at=timezone.now())
    _age(BulkRetry, [done.pk, cancelled.pk, running.pk, recent.pk], "created_at", 91)

    assert sweep()["bulk_retries_pruned"] == 2
    assert set(BulkRetry.objects.values_list("pk", flat=True)) == {running.pk, recent.pk}


def test_decided_cases_go_after_their_retention_and_open_ones_and_effect_vetoes_stay(bot) -> None:
    from outbox.models import Effect, EffectState

    long_ago = timezone.now() - timedelta(days=181)
    decided = ReconciliationCase.objects.create(
        idempotency_key="a", status=CaseStatus.RESOLVED, decision=Decision.CANCEL, decided_at=long_ago
    )
    still_open = ReconciliationCase.objects.create(idempotency_key="b")
    effect = Effect.objects.create(key="crm:lead:1", state=EffectState.UNKNOWN)
    veto = ReconciliationCase.objects.create(
        effect=effect,
        idempotency_key=effect.key,
        status=CaseStatus.RESOLVED,
        decision=Decision.CANCEL,
        decided_at=long_ago,
    )
    _age(ReconciliationCase, [decided.pk, still_open.pk, veto.pk], "created_at", 181)

    assert sweep()["cases_pruned"] == 1
    assert set(ReconciliationCase.objects.values_list("pk", flat=True)) == {still_open.pk, veto.pk}


def test_audit_entries_stay_by_default_and_go_only_when_a_retention_is_set(bot) -> None:
    alice = User.objects.create_user("alice")
    entry = AuditEntry.objects.create(actor=alice, action="retry", target="outbox.OutboundMessage:1")
    _age(AuditEntry, entry.pk, "created_at", 3650)

    assert sweep()["audit_entries_pruned"] == 0
    assert AuditEntry.objects.filter(pk=entry.pk).exists()
    with override_settings(DOVECOTE_AUDIT_RETENTION_DAYS=365):
        assert sweep()["audit_entries_pruned"] == 1


# --------------------------------------------------------------------------- how rows are deleted
def test_deleting_an_update_takes_its_runs_letters_and_analytics_and_unlinks_its_messages(bot) -> None:
    from bots.models import AnalyticsEvent
    from outbox.retention import delete_rows

    letter = failed_run(bot)
    DeadLetter.objects.filter(pk=letter.pk).update(status=DeadLetterStatus.RESOLVED)
    update = letter.consumer_run.update
    AnalyticsEvent.objects.create(bot=bot, update=update, received_at=update.received_at)
    answer = message_row(bot, key="answer", state=State.SENT, source_update=update)
    bystander = stored_update(bot)

    assert delete_rows(InboundUpdate, [update.pk]) == 1

    assert list(InboundUpdate.objects.values_list("pk", flat=True)) == [bystander.pk]
    assert not ConsumerRun.objects.exists()
    assert not DeadLetter.objects.exists()
    assert not AnalyticsEvent.objects.exists()
    answer.refresh_from_db()
    assert answer.source_update_id is None


def test_deleting_rows_with_a_delete_signal_receiver_goes_through_djangos_collector(bot) -> None:
    from django.db.models.signals import post_delete

    from outbox.retention import delete_rows

    message = message_row(bot, key="watched", state=State.SENT)
    seen: list[int] = []

    def receiver(sender, instance, **kwargs) -> None:
        seen.append(instance.pk)

    post_delete.connect(receiver, sender=OutboundMessage, dispatch_uid="test-retention")
    try:
        assert delete_rows(OutboundMessage, [message.pk]) == 1
    finally:
        post_delete.disconnect(dispatch_uid="test-retention", sender=OutboundMessage)
    assert seen == [message.pk]
