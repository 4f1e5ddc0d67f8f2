"""Rows for the reconciliation tests, made the way the app makes them."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

from django.utils import timezone

from bots.inbox import inbox_update_store
from bots.models import Bot, InboundUpdate
from outbox.models import Attempt, OutboundMessage, State

_update_ids = itertools.count(7_000_000)


def stored_update(bot: Bot, *, chat_id: int = 4242, text: str = "/buy", update_id: int | None = None) -> InboundUpdate:
    payload = {
        "update_id": update_id or next(_update_ids),
        "message": {
            "message_id": next(_update_ids),
            "date": 1700000000,
            "chat": {"id": chat_id, "type": "private"},
            "from": {"id": chat_id, "is_bot": False, "first_name": "Alice"},
            "text": text,
        },
    }
    update, _ = inbox_update_store(bot=bot, payload=payload)
    return update


def message_row(bot: Bot, *, key: str = "k-1", state: str = State.PENDING, **fields: Any) -> OutboundMessage:
    """An outbox row in a given state, written directly (as a crashed worker would leave it)."""
    now = timezone.now()
    defaults: dict[str, Any] = {
        "chat_id": 4242,
        "payload": {"text": "hello"},
        "next_attempt_at": now,
        "state": state,
    }
    if state == State.SENDING:
        defaults.update(lease_owner="dead-worker:1", lease_expires_at=now - timedelta(seconds=5))
    if state == State.SENT:
        defaults.update(sent_at=now)
    defaults.update(fields)
    return OutboundMessage.objects.create(bot=bot, idempotency_key=key, **defaults)


def open_attempt(message: OutboundMessage) -> Attempt:
    """The request was started (the attempt row is written first) and never finished."""
    OutboundMessage.objects.filter(pk=message.pk).update(attempts=message.attempts + 1)
    message.refresh_from_db()
    return Attempt.objects.create(
        message=message, number=message.attempts, worker="dead-worker:1", started_at=timezone.now()
    )
