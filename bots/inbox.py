"""The inbox: the webhook's bot, cached per process, and an update stored once per (bot,
update_id), its bot's router woken after the commit (bots/routing.py)."""

from __future__ import annotations

import time
from typing import Any

from django.db import DEFAULT_DB_ALIAS, transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from django.utils import timezone

from bots import routing
from bots.models import Bot, InboundUpdate
from core import rows
from core.ids import time_ordered_id

# Update fields that carry a message-like object with a chat.
_MESSAGE_TYPES = (
    "message",
    "edited_message",
    "channel_post",
    "edited_channel_post",
    "business_message",
    "edited_business_message",
)


def new_trace_id() -> str:
    """The id that follows an update through its runs, messages, dead letters and log lines:
    time-ordered, so the hot tables' trace_id indexes grow at one edge (core/ids.py)."""
    return time_ordered_id()


def describe_update(payload: dict[str, Any]) -> dict[str, Any]:
    """The indexed fields of an Update: its type, chat, user and message id."""
    update_type = next((k for k in payload if k != "update_id"), "")
    body = payload.get(update_type) if update_type else None
    fields: dict[str, Any] = {"update_type": update_type[:40]}
    if not isinstance(body, dict):
        return fields
    message = body if update_type in _MESSAGE_TYPES else body.get("message")
    chat = (message or {}).get("chat") if isinstance(message, dict) else None
    if not isinstance(chat, dict):
        chat = body.get("chat") if isinstance(body.get("chat"), dict) else None
    sender = body.get("from") if isinstance(body.get("from"), dict) else None
    if isinstance(chat, dict) and as_int64(chat.get("id")) is not None:
        fields["chat_id"] = as_int64(chat.get("id"))
        fields["chat_type"] = str(chat.get("type", ""))[:20]
    if isinstance(sender, dict):
        fields["user_id"] = as_int64(sender.get("id"))
    if isinstance(message, dict):
        fields["message_id"] = as_int64(message.get("message_id"))
    return fields


def as_int64(value: Any) -> int | None:
    """The value when it is an int that fits a bigint column (an update's ids), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    return None


# The webhook's bot, per process, for this long: a burst of updates does not look the bot
# up once per update. A change saved in this process forgets it at once (`forget_bot`);
# other processes see a deactivation or a new secret within this time.
BOT_CACHE_SECONDS = 5.0
_bots: dict[str, tuple[float, Bot]] = {}


def webhook_bot(name: str) -> Bot | None:
    """The active bot of this name, from the per-process cache when fresh."""
    cached = _bots.get(name)
    now = time.monotonic()
    if cached is not None and cached[0] > now:
        return cached[1]
    bot = Bot.objects.filter(name=name, is_active=True).first()
    if bot is None:
        # Unknown names are not cached: a scanner's made-up names must not fill memory.
        _bots.pop(name, None)
        return None
    _bots[name] = (now + BOT_CACHE_SECONDS, bot)
    return bot


@receiver([post_save, post_delete], sender=Bot, dispatch_uid="bots.forget_bot")
def forget_bot(sender: Any = None, instance: Bot | None = None, **kwargs: Any) -> None:
    """Drop the cached webhook bots (all of them: a renamed bot's old name too)."""
    _bots.clear()


def inbox_update_store(
    *, bot: Bot, payload: dict[str, Any], trace_id: str | None = None, wake_soon: bool = False
) -> tuple[InboundUpdate, bool]:
    """Insert the update once per (bot, update_id) and dispatch its routing after commit.
    Returns (update, created); a duplicate reads the row that was stored first. `wake_soon`:
    the router's wake-up is left to this process's wake-up thread."""
    trace_id = trace_id or new_trace_id()
    values = _update_values(bot, payload, trace_id)
    pk = _update_insert(bot, values, wake_soon=wake_soon)
    if pk is None:
        return InboundUpdate.objects.get(bot=bot, update_id=payload["update_id"]), False
    del values["bot_id"]
    row = InboundUpdate(pk=pk, bot=bot, **values)
    row._state.adding, row._state.db = False, DEFAULT_DB_ALIAS
    return row, True


def inbox_update_receive(*, bot: Bot, payload: dict[str, Any], body: str | None, trace_id: str) -> tuple[bool, str]:
    """The webhook's hot path: one statement (INSERT ... ON CONFLICT DO NOTHING RETURNING id,
    no model instance, `body` stored as it came when given), the router's wake-up left to
    this process's wake-up thread so the answer does not wait on Redis or the broker.
    Returns (stored: False for a duplicate, the update's type)."""
    values = _update_values(bot, payload, trace_id)
    if body is not None:
        values["payload"] = rows.JSONText(body)
    return _update_insert(bot, values, wake_soon=True) is not None, values["update_type"]


def _update_values(bot: Bot, payload: dict[str, Any], trace_id: str) -> dict[str, Any]:
    now = timezone.now()
    return {
        "bot_id": bot.pk,
        "update_id": payload["update_id"],
        "payload": payload,
        "trace_id": trace_id,
        "next_attempt_at": now,
        "received_at": now,
        **describe_update(payload),
    }


def _update_insert(bot: Bot, values: dict[str, Any], *, wake_soon: bool = False) -> int | None:
    """Write the update's row unless (bot, update_id) is stored; have a router woken after
    the commit. The new row's pk, or None for a duplicate."""
    pk = rows.insert_values_once(InboundUpdate, values, unique=("bot_id", "update_id"))
    if pk is None:
        return None
    wake = routing.inbox_router_wake_soon if wake_soon else routing.inbox_router_wake
    transaction.on_commit(lambda: wake(bot.pk, pk))  # at once in autocommit (the webhook)
    return pk
