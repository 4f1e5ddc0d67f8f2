"""An operator cancels a waiting message, or every waiting message of a broadcast, from the
admin: object-tools link, confirmation with a reason, POST with CSRF, the cancel_message
permission, the outbox service, the change log and the audit log."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.urls import reverse

from outbox import services
from outbox.models import OutboundMessage, State
from reconciliation.models import AuditEntry
from tests.reconciliation.factories import message_row
from tests.reconciliation.triage_helpers import logged_in, persona


@pytest.fixture
def viewer(db: None):
    """Staff who may look at messages but hold no cancel permission."""
    user = persona("victor")
    user.user_permissions.add(Permission.objects.get(codename="view_outboundmessage"))
    return user


def cancel_url(message: OutboundMessage) -> str:
    return reverse("admin:outbox_outboundmessage_cancel", args=[message.pk])


def broadcast_url(message: OutboundMessage) -> str:
    return reverse("admin:outbox_outboundmessage_cancel_broadcast", args=[message.pk])


def state_of(message: OutboundMessage) -> str:
    return OutboundMessage.objects.values_list("state", flat=True).get(pk=message.pk)


def test_the_operator_group_holds_the_cancel_permission(operator) -> None:
    assert operator.has_perm("reconciliation.cancel_message")


def test_the_message_page_links_cancel_for_an_operator_and_not_for_a_viewer(bot, operator, viewer) -> None:
    message = message_row(bot, key="bc:news:1", broadcast="news")
    change = reverse("admin:outbox_outboundmessage_change", args=[message.pk])
    page = logged_in(operator).get(change).content.decode()
    assert cancel_url(message) in page
    assert broadcast_url(message) in page
    page = logged_in(viewer).get(change).content.decode()
    assert cancel_url(message) not in page
    assert broadcast_url(message) not in page


def test_a_get_on_cancel_only_asks_for_a_reason(bot, operator) -> None:
    message = message_row(bot)
    page = logged_in(operator).get(cancel_url(message))
    assert page.status_code == 200
    assert "csrfmiddlewaretoken" in page.content.decode()
    assert 'name="reason"' in page.content.decode()
    assert state_of(message) == State.PENDING


def test_cancel_with_a_reason_cancels_the_waiting_message_and_writes_the_change_and_audit_logs(bot, operator) -> None:
    message = message_row(bot)
    response = logged_in(operator).post(cancel_url(message), {"reason": "wrong text"})
    assert response.status_code == 302
    message.refresh_from_db()
    assert message.state == State.CANCELLED
    assert "wrong text" in message.cancel_reason
    audit = AuditEntry.objects.get(action="message.cancel")
    assert (audit.actor, audit.target, audit.reason, audit.outcome) == (
        operator,
        f"outbox.OutboundMessage:{message.pk}",
        "wrong text",
        "cancelled",
    )
    assert LogEntry.objects.filter(object_id=str(message.pk), change_message__contains="cancelled").exists()


def test_cancel_without_a_reason_changes_nothing(bot, operator) -> None:
    message = message_row(bot)
    assert logged_in(operator).post(cancel_url(message), {"reason": ""}).status_code == 200
    assert state_of(message) == State.PENDING


def test_cancel_leaves_a_sent_message_alone_and_says_so(bot, operator) -> None:
    message = message_row(bot, state=State.SENT)
    logged_in(operator).post(cancel_url(message), {"reason": "too late"})
    assert state_of(message) == State.SENT
    assert AuditEntry.objects.get(action="message.cancel").outcome.startswith("not waiting")


def test_cancel_needs_the_permission_and_the_csrf_token(bot, operator, viewer) -> None:
    message = message_row(bot)
    assert logged_in(viewer).post(cancel_url(message), {"reason": "x"}).status_code == 403
    assert logged_in(viewer).get(broadcast_url(message)).status_code == 403
    assert logged_in(operator, csrf=True).post(cancel_url(message), {"reason": "x"}).status_code == 403
    assert state_of(message) == State.PENDING
    assert not AuditEntry.objects.exists()


def test_cancel_broadcast_cancels_every_waiting_message_of_that_broadcast_and_nothing_else(bot, operator) -> None:
    waiting = [message_row(bot, key=f"bc:news:{i}", chat_id=100 + i, broadcast="news") for i in range(3)]
    retrying = message_row(bot, key="bc:news:9", chat_id=109, broadcast="news", state=State.RETRY)
    sent = message_row(bot, key="bc:news:8", chat_id=108, broadcast="news", state=State.SENT)
    other = message_row(bot, key="bc:promo:1", chat_id=100, broadcast="promo")
    alone = message_row(bot, key="k-alone", chat_id=100)

    page = logged_in(operator).get(broadcast_url(waiting[0]))
    assert page.status_code == 200
    assert "4 messages" in page.content.decode()
    response = logged_in(operator).post(broadcast_url(waiting[0]), {"reason": "sent by mistake"})
    assert response.status_code == 302

    assert {state_of(m) for m in [*waiting, retrying]} == {State.CANCELLED}
    assert [state_of(m) for m in (sent, other, alone)] == [State.SENT, State.PENDING, State.PENDING]
    audit = AuditEntry.objects.get(action="broadcast.cancel")
    assert audit.details["cancelled"] == 4
    assert audit.reason == "sent by mistake"
    assert audit.target == f"outbox.broadcast:{bot.pk}:news"


def test_the_broadcast_service_cancels_in_batches_and_leaves_a_message_being_sent(bot) -> None:
    from outbox import transitions

    for i in range(7):
        message_row(bot, key=f"bc:big:{i}", chat_id=200 + i, broadcast="big")
    sending = message_row(bot, key="bc:big:99", chat_id=299, broadcast="big", state=State.SENDING)
    assert transitions.cancel_broadcast_batch(bot_id=bot.pk, broadcast="big", reason="r", batch=3) != []
    assert services.outbound_broadcast_cancel(bot_id=bot.pk, broadcast="big", reason="r") == 4
    assert OutboundMessage.objects.filter(broadcast="big", state=State.CANCELLED).count() == 7
    assert state_of(sending) == State.SENDING
