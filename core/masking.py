"""Who sees payloads in full, and what everyone else sees of them: the one rule every admin
page, the dead letter's story and its export apply.

Masking keeps an allow-list: a value is shown only under a field Telegram fills with an
identifier, a date, a type or a size (flags and empty values everywhere); everything else,
any field Telegram adds tomorrow included, is masked at any depth. The permission is
reconciliation's `view_payload`, named here rather than imported. `for_user` is what a page
renders. Why: docs/DESIGN.md."""

from __future__ import annotations

from typing import Any

from core.payloads import clip

PAYLOAD_PERMISSION = "reconciliation.view_payload"
MASK = "••• masked •••"

# Which update, chat, user, message, file or payment: ids Telegram (or the bot) made, never
# one a person typed. Not `foursquare_id` or `google_place_id`: those name a place.
_IDS = frozenset(
    {
        "id",
        "update_id",
        "message_id",
        "message_thread_id",
        "media_group_id",
        "chat_id",
        "user_id",
        "user_chat_id",
        "from_chat_id",
        "reply_to_message_id",
        "migrate_to_chat_id",
        "migrate_from_chat_id",
        "inline_message_id",
        "callback_query_id",
        "chat_instance",
        "result_id",
        "poll_id",
        "request_id",
        "boost_id",
        "business_connection_id",
        "effect_id",
        "message_effect_id",
        "custom_emoji_id",
        "file_id",
        "file_unique_id",
        "small_file_id",
        "small_file_unique_id",
        "big_file_id",
        "big_file_unique_id",
        "shipping_option_id",
        "telegram_payment_charge_id",
        "provider_payment_charge_id",
    }
)
# When: Unix times.
_DATES = frozenset(
    {
        "date",
        "edit_date",
        "forward_date",
        "until_date",
        "expire_date",
        "close_date",
        "start_date",
        "add_date",
        "remove_date",
        "expiration_date",
    }
)
# What kind: Telegram's enumerations (a chat's type, an entity's, a member's status).
_TYPES = frozenset({"type", "status", "chat_type", "mime_type", "parse_mode"})
# How big: shown when they are numbers (an inline query's `offset` is a string the bot chose).
_SIZES = frozenset(
    {"width", "height", "duration", "file_size", "offset", "length", "voter_count", "total_voter_count", "total_count"}
)
_SHOWN = _IDS | _DATES | _TYPES


def can_view_payload(user: Any) -> bool:
    """Whether `user` sees what people wrote and who they are, unmasked."""
    return bool(user and user.has_perm(PAYLOAD_PERMISSION))


def _shown(field: str | None, value: Any) -> bool:
    """May this scalar, found under `field` (its nearest key), be shown without payload access?"""
    if value is None or value == "" or isinstance(value, bool):
        return True
    if field in _SHOWN:
        return True
    return field in _SIZES and isinstance(value, int | float)


def mask(value: Any) -> Any:
    """The same JSON shape with every value masked but ids, dates, types, sizes, flags and
    empty ones. A list's items are judged by the list's field. Walked with an explicit stack,
    so a payload of any depth is masked without recursion."""
    holder: list[Any] = [None]
    stack: list[tuple[Any, str | None, Any, Any]] = [(value, None, holder, 0)]
    while stack:
        item, field, parent, slot = stack.pop()
        if isinstance(item, dict):
            copy: dict[str, Any] = dict.fromkeys(item)
            stack.extend((child, key, copy, key) for key, child in item.items())
            parent[slot] = copy
        elif isinstance(item, list):
            items: list[Any] = [None] * len(item)
            stack.extend((child, field, items, i) for i, child in enumerate(item))
            parent[slot] = items
        else:
            parent[slot] = item if _shown(field, item) else MASK
    return holder[0]


def for_user(user: Any, value: Any) -> Any:
    """What `user` may see of a payload: in full with payload access, masked without it;
    clipped either way (templates' pprint and json.dumps recurse once per level)."""
    return shown(value, visible=can_view_payload(user))


def shown(value: Any, *, visible: bool) -> Any:
    """`value` in full (`visible`) or masked, clipped to MAX_JSON_DEPTH."""
    return clip(value if visible else mask(value))
