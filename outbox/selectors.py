"""Read-side queries of the outbox."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Model
from django.utils import timezone

from core import rows
from outbox import chat_order, circuits, sql
from outbox import methods as _methods
from outbox import policy as _policy
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
    found = rows.fetch(
        sql.NEXT_OPEN_IN_CHATS,
        [now, now, [m for m, _, _ in sent], [b for _, b, _ in sent], [c for _, _, c in sent]],
    )
    return dict(found)


def outbound_message_for_send(message_id: int, *, now: datetime) -> OutboundMessage | None:
    """The message, its bot, and what the send decides on, in one query: this is the hot
    path (see bench/drain_rate.py). Annotated with `circuit_not_closed` (the bot's circuit
    is open or half-open), `circuit_dirty` (a circuit with failures to forget: a success
    must reset it) and `blocked` (an earlier ordered message to the chat is still open)."""
    found = rows.fetch(sql.for_send(), [now, message_id])
    if not found:
        return None
    message, (not_closed, dirty, blocked) = sql.message_with_bot(found[0])
    message.circuit_not_closed, message.circuit_dirty, message.blocked = not_closed, dirty, blocked
    return message


def bot_and_circuit(bot_id: int) -> tuple[Model | None, Circuit | None]:
    """The bot and its Bot API circuit (None where there is none), as the drain starts: one
    fixed statement, prepared once per connection, not two querysets compiled on every
    drain."""
    found = rows.fetch(sql.bot_and_circuit(), [circuits.bot_scope(bot_id), bot_id])
    return sql.bot_and_circuit_of(found[0]) if found else (None, None)


def bot_circuit(bot_id: int) -> Circuit | None:
    """The bot's Bot API circuit, or None: the drain's look before each batch."""
    found = rows.fetch(sql.CIRCUIT, [circuits.bot_scope(bot_id)])
    return rows.from_row(Circuit, found[0]) if found else None  # type: ignore[return-value]


bot_model = sql.bot_model


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

# A consumer's circuit scope (`consumer:<name>`).
consumer_scope = circuits.consumer_scope
# The Bot API methods the outbox sends, and the key prefix of a call whose whole result is kept.
SUPPORTED_METHODS = _methods.SUPPORTED_METHODS
FULL_RESULT_KEY_PREFIX = _methods.FULL_RESULT_KEY_PREFIX
# The longest countdown given to the broker; a later task is published by the sweeper when due.
MAX_BROKER_COUNTDOWN_SECONDS = _policy.MAX_BROKER_COUNTDOWN_SECONDS
