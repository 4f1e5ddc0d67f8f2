"""Read-side queries of the outbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache

from django.db import connection
from django.db.models import JSONField, Model
from django.utils import timezone

from core import rows
from outbox import chat_order, circuits
from outbox.models import Circuit, OutboundMessage, State
from outbox.splitting import MAX_PARTS, part_key


def earlier_open_message_exists(message: OutboundMessage) -> bool:
    """True when an earlier ordered message to the same chat must go first (outbox/chat_order.py)."""
    return chat_order.is_blocked(message, now=timezone.now())


def outbound_message_part_ids(message: OutboundMessage) -> list[int]:
    """The ids of the messages one enqueue wrote, in order: this message's alone, or - for
    the first part of a split text - every part's (their keys derive from its key)."""
    keys = {part_key(message.idempotency_key, n): n for n in range(2, MAX_PARTS + 1)}
    rows = OutboundMessage.objects.filter(bot_id=message.bot_id, idempotency_key__in=list(keys)).values_list(
        "idempotency_key", "id"
    )
    return [message.pk] + [pk for _, pk in sorted(rows, key=lambda row: keys[row[0]])]


def next_open_message_in_chat(*, bot_id: int, chat_id: int) -> int | None:
    """The chat's head, when it is waiting and due: the message to hand to a worker next."""
    now = timezone.now()
    waiting = OutboundMessage.objects.filter(
        bot_id=bot_id, chat_id=chat_id, state__in=[State.PENDING, State.RETRY], next_attempt_at__lte=now
    )
    return chat_order.heads(waiting, now=now).order_by("id").values_list("id", flat=True).first()


def next_broadcast_due(bot_id: int) -> datetime | None:
    """When the bot's next waiting broadcast message falls due (past: one is due now), or
    None: the broadcast drain's look before it stops (outbox_bulk_due_idx)."""
    waiting = OutboundMessage.objects.filter(bot_id=bot_id, state__in=[State.PENDING, State.RETRY]).exclude(
        broadcast=""
    )
    return waiting.order_by("next_attempt_at").values_list("next_attempt_at", flat=True).first()


def next_open_messages_in_chats(sent: list[tuple[int, int, int]]) -> dict[int, int | None]:
    """next_open_message_in_chat for a batch just marked sent, in one statement (PostgreSQL):
    {message id: its chat's head, or None} for (message id, bot id, chat id) triples.

    Run after the sent mark commits, not inside it: a reply committed while the marking
    statement ran is invisible to its snapshot, and the reply's own send (or the drain it
    wakes) may still see its head in flight; the one that looked last would find nothing and
    the reply would wait for the sweeper. After the commit, either this look sees the reply
    or the reply's look sees its head sent."""
    now = timezone.now()
    table = OutboundMessage._meta.db_table
    found = rows.fetch(
        f"""SELECT v.id, (SELECT h.id FROM {table} h WHERE h.bot_id = v.bot_id AND h.chat_id = v.chat_id
                   AND h.state IN ('pending', 'retry') AND h.next_attempt_at <= %s
                   AND NOT {chat_order.blocked_sql("h")} ORDER BY h.id LIMIT 1)
            FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[]) AS v(id, bot_id, chat_id)""",  # noqa: S608
        [now, now, [m for m, _, _ in sent], [b for _, b, _ in sent], [c for _, _, c in sent]],
    )
    return dict(found)


def outbound_message_for_send(message_id: int, *, now: datetime) -> OutboundMessage | None:
    """The message, its bot, and what the send decides on, in one query: this is the hot
    path (see bench/drain_rate.py). Annotated with `circuit_not_closed` (the bot's circuit
    is open or half-open), `circuit_dirty` (a circuit with failures to forget: a success
    must reset it) and `blocked` (an earlier ordered message to the chat is still open)."""
    Bot = bot_model()
    with connection.cursor() as cursor:
        cursor.execute(_for_send_sql(), [now, message_id])
        row = cursor.fetchone()
    if row is None:
        return None
    n_message = len(_columns(OutboundMessage)[0])
    n_bot = len(_columns(Bot)[0])
    message = _from_row(OutboundMessage, list(row[:n_message]))
    bot = _from_row(Bot, list(row[n_message : n_message + n_bot]))
    message._state.fields_cache["bot"] = bot  # as select_related("bot") would
    message.circuit_not_closed, message.circuit_dirty, message.blocked = row[n_message + n_bot :]
    return message


def bot_and_circuit(bot_id: int) -> tuple[Model | None, Circuit | None]:
    """The bot and its Bot API circuit (None where there is none), as the drain starts: one
    fixed statement, prepared once per connection, not two querysets compiled on every
    drain."""
    Bot = bot_model()
    found = rows.fetch(_bot_and_circuit_sql(), [circuits.bot_scope(bot_id), bot_id])
    if not found:
        return None, None
    n_bot = len(Bot._meta.concrete_fields)
    row = found[0]
    circuit = rows.from_row(Circuit, row[n_bot:]) if row[n_bot] is not None else None
    return rows.from_row(Bot, row[:n_bot]), circuit  # type: ignore[return-value]


def bot_circuit(bot_id: int) -> Circuit | None:
    """The bot's Bot API circuit, or None: the drain's look before each batch."""
    found = rows.fetch(_circuit_sql(), [circuits.bot_scope(bot_id)])
    return rows.from_row(Circuit, found[0]) if found else None  # type: ignore[return-value]


@cache
def _bot_and_circuit_sql() -> str:
    Bot = bot_model()
    b, c = Bot._meta.db_table, Circuit._meta.db_table
    columns = f"{rows.selected_columns(Bot, 'b')}, {rows.selected_columns(Circuit, 'c')}"
    return f"SELECT {columns} FROM {b} b LEFT JOIN {c} c ON c.scope = %s WHERE b.id = %s"  # noqa: S608 - _meta


@cache
def _circuit_sql() -> str:
    table = Circuit._meta.db_table
    return f"SELECT {rows.selected_columns(Circuit, 'c')} FROM {table} c WHERE c.scope = %s"  # noqa: S608 - _meta


def bot_model() -> type[Model]:
    """The bot model, through the outbox's foreign key: outbox imports nothing from bots."""
    return OutboundMessage._meta.get_field("bot").related_model  # type: ignore[return-value]


@cache
def _columns(model: type[Model]) -> tuple[list[str], list[int]]:
    fields = model._meta.concrete_fields
    return [f.column for f in fields], [i for i, f in enumerate(fields) if isinstance(f, JSONField)]


def _from_row(model: type[Model], values: list) -> Model:
    # JSON columns arrive as text (Django decodes them, as here); the other columns need no
    # conversion.
    _, json_positions = _columns(model)
    for i in json_positions:
        if isinstance(values[i], str):
            values[i] = json.loads(values[i])
    return model.from_db(connection.alias, None, values)


@cache
def _for_send_sql() -> str:
    Bot = bot_model()
    message_columns, _ = _columns(OutboundMessage)
    bot_columns, _ = _columns(Bot)
    m, b, c = OutboundMessage._meta.db_table, Bot._meta.db_table, Circuit._meta.db_table
    select = ", ".join([f"m.{col}" for col in message_columns] + [f"b.{col}" for col in bot_columns])
    bot_scope = f"'{circuits.BOT_PREFIX}' || m.bot_id::text"
    # The open-states test lets PostgreSQL use outbox_open_chat_idx for the chat's order.
    return f"""
        SELECT {select},
          {circuits.not_closed_sql(bot_scope)},
          EXISTS (SELECT 1 FROM {c} c WHERE c.scope = {bot_scope}
                    AND NOT (c.state = 'closed' AND c.consecutive_failures = 0)),
          {chat_order.blocked_sql("m")}
        FROM {m} m JOIN {b} b ON b.id = m.bot_id
        WHERE m.id = %s
    """  # noqa: S608 - names from _meta, values as parameters


def message_columns() -> list[str]:
    """The outbox table's columns, in the order `message_from_row` reads them."""
    return _columns(OutboundMessage)[0]


def message_from_row(values: list) -> OutboundMessage:
    """An OutboundMessage from a raw row of `message_columns()` (e.g. an UPDATE's RETURNING)."""
    return _from_row(OutboundMessage, values)  # type: ignore[return-value]


def api_client_bot_ids(user: Model) -> set[int] | None:
    """The bots a REST API user may use: None for a superuser (all of them), else the bots
    granted to its ApiClient (none without one)."""
    from outbox.models import ApiClient

    if getattr(user, "is_superuser", False):
        return None
    return set(ApiClient.bots.through.objects.filter(apiclient__user=user).values_list("bot_id", flat=True))


def api_client_payload_access(user: Model) -> bool:
    from outbox.models import ApiClient

    if getattr(user, "is_superuser", False):
        return True
    return ApiClient.objects.filter(user=user, payload_access=True).exists()


# --- The outbox's reads for the bots app ----------------------------------------------------
# bots uses the outbox through services, selectors (here), models and botapi only (the
# import-linter contract "bots uses the outbox through its surface", pyproject.toml).
from outbox import methods as _methods  # noqa: E402
from outbox import policy as _policy  # noqa: E402

# A consumer's circuit scope (`consumer:<name>`).
consumer_scope = circuits.consumer_scope
# The Bot API methods the outbox sends, and the key prefix of a call whose whole result is kept.
SUPPORTED_METHODS = _methods.SUPPORTED_METHODS
FULL_RESULT_KEY_PREFIX = _methods.FULL_RESULT_KEY_PREFIX
# The longest countdown given to the broker; a later task is published by the sweeper when due.
MAX_BROKER_COUNTDOWN_SECONDS = _policy.MAX_BROKER_COUNTDOWN_SECONDS
