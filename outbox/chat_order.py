"""The one rule of a chat's order: only the head of a chat's queue may go.

An ordered message may be sent only when no earlier ordered message (smaller id) of the same
bot and chat is still open: `retry`, `sending`, or `pending` and due (a `send_at` in the future
does not hold the chat up). `unknown`, `failed`, `cancelled` and `sent` never block; unordered
messages never wait and never block. Every path that chooses what to send next uses this
module or its SQL (outbox/sql.py `blocked`). Every write of an ordered message takes its
chat's write lock first (`write_lock`), so a check never misses an earlier uncommitted
message. Why: docs/DESIGN.md."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import BooleanField, QuerySet
from django.db.models.expressions import RawSQL

from outbox import sql
from outbox.models import OutboundMessage

_TABLE = OutboundMessage._meta.db_table


def blocked_expression(now: datetime) -> RawSQL:
    """The rule (outbox/sql.py `blocked`, its SQL) as an ORM expression on OutboundMessage
    querysets: true when the message must wait for an earlier one of its chat."""
    return RawSQL(sql.blocked(_TABLE), [now], output_field=BooleanField())  # noqa: S611 - no input in the SQL


def heads(qs: QuerySet[OutboundMessage], *, now: datetime) -> QuerySet[OutboundMessage]:
    """Only the messages of `qs` that their chat's order lets go now."""
    return qs.alias(blocked_by_earlier=blocked_expression(now)).filter(blocked_by_earlier=False)


def is_blocked(message: OutboundMessage, *, now: datetime) -> bool:
    """True when an earlier message of the chat must go first (see the module's rule)."""
    rows = OutboundMessage.objects.filter(pk=message.pk).annotate(blocked=blocked_expression(now))
    return bool(rows.values_list("blocked", flat=True).first())


_U64 = (1 << 64) - 1


def chat_lock_key(bot_id: int, chat_id: int) -> int:
    """A chat's advisory lock key (a signed 64-bit int, stable across processes): the bot id
    scattered by a multiplicative hash, mixed with the chat id."""
    key = ((bot_id * 0x9E3779B97F4A7C15) ^ chat_id) & _U64
    return key - (1 << 64) if key >= 1 << 63 else key


def write_lock(messages: Iterable[OutboundMessage]) -> tuple[str, list[Any]] | None:
    """The statement that takes the write locks of these messages' chats, to run before their
    insert in its transaction (core/rows.py `before`), or None when none is ordered."""
    keys = sorted({chat_lock_key(m.bot_id, m.chat_id) for m in messages if m.ordered and m.chat_id is not None})
    return (sql.CHAT_WRITE_LOCK, [keys]) if keys else None


def lock_chat(*, bot_id: int, chat_id: int) -> None:
    """Take a chat's write lock in the current transaction (an atomic block that writes its
    ordered messages through the ORM)."""
    with connection.cursor() as cursor:
        cursor.execute(sql.CHAT_WRITE_LOCK, [[chat_lock_key(bot_id, chat_id)]])
