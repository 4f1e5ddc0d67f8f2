"""Ambiguous outcomes: an unknown send opens a case; only a decision closes it - an
operator's (mark delivered, resend with the same key, cancel) or the `resend` policy."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import override_settings
from django.utils import timezone

from outbox.effects import effect_run
from outbox.models import Effect, EffectState, OnAmbiguous, OutboundMessage, State
from outbox.sending.single import outbound_message_send
from outbox.services import outbound_message_enqueue
from reconciliation import services, sweeper
from reconciliation.models import AuditEntry, CaseStatus, Decision, ReconciliationCase
from reconciliation.sweeper import sweep
from tests.support import wait_until

NO_WAIT = {"DOVECOTE_REDISPATCH_GRACE_SECONDS": 0, "DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS": 0}


@pytest.fixture
def alice(db: None):
    return get_user_model().objects.create_user("alice", password="x", is_staff=True)


def lost_answer(bot, sandbox, *, key: str = "order-1", **options) -> OutboundMessage:
    """Telegram delivers the message, then the connection drops before the answer."""
    sandbox.fault("drop_after_deliver", count=1)
    message, _ = outbound_message_enqueue(
        bot_id=bot.pk, chat_id=4242, payload={"text": "Your order is confirmed"}, idempotency_key=key, **options
    )
    assert outbound_message_send(message.pk).status.startswith("unknown")
    message.refresh_from_db()
    return message


def send_now(message: OutboundMessage) -> str:
    """Send, waiting out the chat's 1 msg/s limit (the first send used this second's slot)."""
    return wait_until(
        lambda: (status := outbound_message_send(message.pk).status) not in ("rate-limited", "not-due") and status,
        timeout=5,
        interval=0.2,
    )


def test_a_lost_answer_leaves_the_message_unknown_with_an_open_case(bot, sandbox) -> None:
    message = lost_answer(bot, sandbox)

    assert message.state == State.UNKNOWN
    assert message.attempts == 1
    assert len(sandbox.messages(token=bot.token)) == 1
    case = ReconciliationCase.objects.get(message=message)
    assert (case.status, case.policy, case.idempotency_key) == (CaseStatus.OPEN, "hold", "order-1")
    assert case.known_facts["attempts"] == 1


def test_the_sweeper_never_resends_a_held_unknown_message(bot, sandbox) -> None:
    message = lost_answer(bot, sandbox)
    with override_settings(**NO_WAIT):
        sweep()
        sweep()
    message.refresh_from_db()
    assert message.state == State.UNKNOWN
    assert outbound_message_send(message.pk).status == "not-waiting"
    assert len(sandbox.messages(token=bot.token)) == 1
    assert ReconciliationCase.objects.get(message=message).status == CaseStatus.OPEN


def test_mark_delivered_records_who_why_and_the_telegram_message_id(bot, sandbox, alice) -> None:
    message = lost_answer(bot, sandbox)
    delivered = sandbox.messages(token=bot.token)[0]["message_id"]
    case = ReconciliationCase.objects.get(message=message)

    services.case_mark_delivered(case, alice, "customer quoted it back", telegram_message_id=delivered)

    message.refresh_from_db()
    assert (message.state, message.telegram_message_id) == (State.SENT, delivered)
    assert message.sent_at is not None
    case.refresh_from_db()
    assert (case.status, case.decision, case.decided_by, case.decision_reason) == (
        CaseStatus.RESOLVED,
        Decision.MARK_DELIVERED,
        alice,
        "customer quoted it back",
    )
    assert case.decided_at is not None
    entry = AuditEntry.objects.get(target=f"outbox.OutboundMessage:{message.pk}")
    assert (entry.actor, entry.action, entry.reason) == (alice, "reconciliation.mark_delivered", case.decision_reason)


def test_resend_sends_again_with_the_same_key(bot, sandbox, alice) -> None:
    message = lost_answer(bot, sandbox)
    case = ReconciliationCase.objects.get(message=message)

    services.case_resend(case, alice, "not in the chat history")
    message.refresh_from_db()
    assert message.state == State.RETRY
    assert send_now(message) == "sent"

    message.refresh_from_db()
    assert (message.state, message.idempotency_key, message.attempts) == (State.SENT, "order-1", 2)
    assert len(sandbox.messages(token=bot.token)) == 2  # the operator accepted a possible duplicate
    assert AuditEntry.objects.filter(action="reconciliation.resend", actor=alice).count() == 1


def test_cancel_stops_the_message_for_good(bot, sandbox, alice) -> None:
    message = lost_answer(bot, sandbox)
    case = ReconciliationCase.objects.get(message=message)

    services.case_cancel(case, alice, "the order was refunded")

    message.refresh_from_db()
    assert (message.state, message.cancel_reason) == (State.CANCELLED, "the order was refunded")
    with pytest.raises(services.CaseNotOpen):
        services.case_resend(case, alice, "changed my mind")
    assert len(sandbox.messages(token=bot.token)) == 1


def test_policy_resend_waits_the_delay_then_resends_and_says_a_duplicate_is_possible(bot, sandbox) -> None:
    message = lost_answer(bot, sandbox, on_ambiguous=OnAmbiguous.RESEND)
    case = ReconciliationCase.objects.get(message=message)
    assert case.policy == "resend"

    with override_settings(DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS=60):
        assert sweep()["messages_auto_resent"] == 0
    with override_settings(**NO_WAIT):
        assert sweep()["messages_auto_resent"] == 1
        assert sweep()["messages_auto_resent"] == 0  # once

    message.refresh_from_db()
    assert message.state == State.RETRY
    case.refresh_from_db()
    assert (case.status, case.decision, case.decided_by) == (CaseStatus.RESOLVED, Decision.AUTO_RESEND, None)
    assert "duplicate is possible" in case.decision_reason
    assert send_now(message) == "sent"
    assert len(sandbox.messages(token=bot.token)) == 2


def test_a_resent_message_that_expires_is_unknown_with_a_case_not_cancelled(bot, sandbox) -> None:
    # Found by the fault schedule of seed 133: delivered, its answer lost, resent by policy,
    # then expired while Telegram answered 504s: "cancelled" said it never reached the chat.
    message = lost_answer(
        bot, sandbox, on_ambiguous=OnAmbiguous.RESEND, expires_at=timezone.now() + timedelta(seconds=2)
    )
    with override_settings(**NO_WAIT):
        assert sweep()["messages_auto_resent"] == 1
    wait_until(lambda: timezone.now() > message.expires_at, timeout=5)

    with override_settings(**NO_WAIT):
        assert sweep()["messages_expired"] == 1
        assert sweep()["messages_auto_resent"] == 0  # expired: not resent by policy either

    message.refresh_from_db()
    assert message.state == State.UNKNOWN
    assert "may be in the chat" in message.last_error
    case = ReconciliationCase.objects.get(message=message, status=CaseStatus.OPEN)
    assert case.known_facts["attempts"] == 1
    assert len(sandbox.messages(token=bot.token)) == 1


def test_a_message_that_expires_without_an_unknown_attempt_is_cancelled(bot, sandbox) -> None:
    sandbox.fault("504", count=1)
    message, _ = outbound_message_enqueue(
        bot_id=bot.pk,
        chat_id=4243,
        payload={"text": "Your order is confirmed"},
        idempotency_key="order-2",
        expires_at=timezone.now() + timedelta(seconds=1),
    )
    assert outbound_message_send(message.pk).status == "retry"
    wait_until(lambda: timezone.now() > message.expires_at, timeout=5)

    assert sweep()["messages_expired"] == 1

    message.refresh_from_db()
    assert message.state == State.CANCELLED
    assert not ReconciliationCase.objects.filter(message=message).exists()


def test_policy_resend_stops_when_the_budget_is_spent(bot, sandbox) -> None:
    message = lost_answer(bot, sandbox, on_ambiguous=OnAmbiguous.RESEND, max_attempts=1)
    with override_settings(**NO_WAIT):
        assert sweep()["messages_auto_resent"] == 0
    message.refresh_from_db()
    assert message.state == State.UNKNOWN
    assert ReconciliationCase.objects.get(message=message).status == CaseStatus.OPEN


def test_unknown_messages_whose_budget_is_spent_do_not_starve_a_resendable_one(bot) -> None:
    now = timezone.now()

    def unknown(key: str, *, attempts: int) -> OutboundMessage:
        return OutboundMessage(
            bot=bot,
            chat_id=4242,
            payload={"text": key},
            idempotency_key=key,
            state=State.UNKNOWN,
            on_ambiguous=OnAmbiguous.RESEND,
            attempts=attempts,
            max_attempts=2,
            next_attempt_at=now,
        )

    # More spent ones than one sweep looks at, all older (first in the queue) than the new one.
    spent = OutboundMessage.objects.bulk_create([unknown(f"spent-{i}", attempts=2) for i in range(sweeper.BATCH + 1)])
    OutboundMessage.objects.filter(pk__in=[m.pk for m in spent]).update(updated_at=now - timedelta(hours=1))
    fresh = OutboundMessage.objects.bulk_create([unknown("fresh", attempts=1)])[0]
    OutboundMessage.objects.filter(pk=fresh.pk).update(updated_at=now - timedelta(minutes=1))
    ReconciliationCase.objects.bulk_create(
        ReconciliationCase(message=m, idempotency_key=m.idempotency_key, policy="resend") for m in [*spent, fresh]
    )

    with override_settings(**NO_WAIT):
        assert sweep()["messages_auto_resent"] == 1

    fresh.refresh_from_db()
    assert (fresh.state, fresh.idempotency_key) == (State.RETRY, "fresh")
    assert OutboundMessage.objects.filter(state=State.UNKNOWN).count() == sweeper.BATCH + 1
    assert ReconciliationCase.objects.filter(status=CaseStatus.OPEN).count() == sweeper.BATCH + 1


def test_an_operator_settles_an_unknown_effect_and_the_barrier_then_skips_it(db: None, alice) -> None:
    Effect.objects.create(key="eff:crm:1", state=EffectState.UNKNOWN, attempts=1)
    with pytest.raises(Exception, match="reconciliation"):
        effect_run("eff:crm:1", lambda e: {"id": "dup"})
    case = ReconciliationCase.objects.get(effect__key="eff:crm:1")

    services.case_mark_delivered(case, alice, "found in the CRM")

    assert Effect.objects.get(key="eff:crm:1").state == EffectState.DONE
    assert effect_run("eff:crm:1", lambda e: {"id": "dup"}) == {"marked_done_by_operator": True}
