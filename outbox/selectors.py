"""Read-side queries of the outbox."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from outbox.models import OutboundMessage, State


def outbound_messages_due(*, overdue_by: timedelta = timedelta(0), limit: int = 500) -> QuerySet[OutboundMessage]:
    """Waiting messages whose time has come (by at least `overdue_by`); uses outbox_due_idx."""
    return OutboundMessage.objects.filter(
        state__in=[State.PENDING, State.RETRY], next_attempt_at__lte=timezone.now() - overdue_by
    ).order_by("next_attempt_at")[:limit]


def outbound_messages_stuck(*, limit: int = 500) -> QuerySet[OutboundMessage]:
    """Messages in `sending` whose worker's lease ran out; uses outbox_lease_idx."""
    return OutboundMessage.objects.filter(state=State.SENDING, lease_expires_at__lt=timezone.now()).order_by(
        "lease_expires_at"
    )[:limit]


def _earlier_open(now: datetime) -> Q:
    return Q(state__in=[State.RETRY, State.SENDING]) | (
        Q(state=State.PENDING) & (Q(send_at__isnull=True) | Q(send_at__lte=now))
    )


def earlier_open_message_exists_expression(now: datetime) -> Exists:
    """`earlier_open_message_exists` as an annotation on OutboundMessage (uses outbox_open_chat_idx)."""
    return Exists(
        OutboundMessage.objects.filter(
            bot_id=OuterRef("bot_id"), chat_id=OuterRef("chat_id"), id__lt=OuterRef("id"), ordered=True
        ).filter(_earlier_open(now))
    )


def earlier_open_message_exists(message: OutboundMessage) -> bool:
    """True when an earlier ordered message to the same chat still waits, retries or sends.

    Pending messages scheduled for later by their sender (send_at in the future) do not
    hold the chat up; one only deferred by a rate limit does. Unknown, failed and
    cancelled ones do not block: the next message proceeds.
    """
    now = timezone.now()
    earlier = OutboundMessage.objects.filter(
        bot_id=message.bot_id, chat_id=message.chat_id, id__lt=message.pk, ordered=True
    )
    return earlier.filter(_earlier_open(now)).exists()


def next_open_message_in_chat(*, bot_id: int, chat_id: int) -> int | None:
    return (
        OutboundMessage.objects.filter(
            bot_id=bot_id, chat_id=chat_id, state__in=[State.PENDING, State.RETRY], next_attempt_at__lte=timezone.now()
        )
        .order_by("id")
        .values_list("id", flat=True)
        .first()
    )
