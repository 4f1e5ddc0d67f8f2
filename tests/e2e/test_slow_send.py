"""A send slower than its worker's lease: the sweeper gives it up (unknown, a case), and then
Telegram's success arrives. The answer settles the message as sent and closes the case as
delivered; `on_ambiguous=resend` finds nothing to resend. Found from outside: the late
success was recorded on the attempt only, the message stayed unknown and was sent twice."""

from __future__ import annotations

import pytest
from django.test import override_settings

from outbox.models import OnAmbiguous, OutboundMessage, State
from outbox.services import outbound_message_enqueue
from reconciliation.models import AuditEntry, CaseStatus, Decision, ReconciliationCase
from reconciliation.sweeper import sweep
from tests.support import Process, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

LEASE = 2  # shorter than the answer takes: a worker stalled past its lease (a paused VM, a GC)
SLOW = 4.0


def test_a_success_after_the_lease_ran_out_settles_the_message_as_sent_and_is_not_resent(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    sandbox.fault("slow", method="sendMessage", delay=SLOW, count=1)
    # The stall a lease shorter than a send stands for: dovecote.E001 silenced for this worker.
    env = {**process_env, "DOVECOTE_SEND_LEASE_SECONDS": str(LEASE), "DOVECOTE_TEST_SILENCED_CHECKS": "dovecote.E001"}
    processes.append(start_worker(env, pool="solo"))
    message, _ = outbound_message_enqueue(
        bot_id=bot.pk,
        chat_id=31,
        payload={"text": "your table is booked"},
        idempotency_key="booking-31",
        on_ambiguous=OnAmbiguous.RESEND,
    )
    wait_until(lambda: sandbox.calls(token=bot.token, method="sendMessage"), message="the request reaching Telegram")

    # The worker is still waiting for the answer when its lease runs out.
    wait_until(lambda: sweep()["messages_unknown"] == 1, timeout=LEASE + 2, interval=0.2)
    assert OutboundMessage.objects.get(pk=message.pk).state == State.UNKNOWN
    case = ReconciliationCase.objects.get(message_id=message.pk)

    wait_until(
        lambda: OutboundMessage.objects.get(pk=message.pk).state == State.SENT,
        timeout=SLOW + 5,
        message="the late answer settling the message",
    )
    case.refresh_from_db()
    assert (case.status, case.decision, case.decided_by) == (CaseStatus.RESOLVED, Decision.MARK_DELIVERED, None)
    assert AuditEntry.objects.filter(action="reconciliation.mark_delivered", target__endswith=f":{message.pk}").exists()

    # The resend policy's delay passes: there is nothing to resend.
    with override_settings(DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS=0, DOVECOTE_REDISPATCH_GRACE_SECONDS=0):
        assert sweep()["messages_auto_resent"] == 0
    message.refresh_from_db()
    assert (message.state, message.attempts, message.telegram_message_id is not None) == (State.SENT, 1, True)
    assert sandbox.sent_texts(token=bot.token) == ["your table is booked"]
