"""How deep the JSON we take in may nest, and how to show stored JSON of any depth.

Telegram's updates nest about ten levels (a reply's pinned message's keyboard) and a Bot API
call's parameters fewer; the webhook and the REST API refuse anything deeper than
MAX_JSON_DEPTH with 400. Python's json, repr and our own walkers recurse, so a payload of a
thousand levels would otherwise end in RecursionError (a 500) in the webhook, the API or the
admin; rows stored some other way (the poller, a shell) are shown clipped.
"""

from __future__ import annotations

from typing import Any

MAX_JSON_DEPTH = 64
CLIPPED = "… nested deeper than {depth} levels, not shown"


def json_depth(value: Any, *, stop_above: int | None = None) -> int:
    """Nesting depth: 0 for a scalar, 1 for a flat object or array. Walks with an explicit
    stack (no recursion at any depth); returns as soon as the depth passes `stop_above`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if stop_above is not None and deepest > stop_above:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def clip(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The same JSON with objects and arrays below `max_depth` levels replaced by a note.
    Its recursion is bounded by `max_depth`, and so is everything that walks the result."""
    if json_depth(value, stop_above=max_depth) <= max_depth:
        return value
    return _clip(value, 1, max_depth)


def _clip(value: Any, depth: int, max_depth: int) -> Any:
    if not isinstance(value, dict | list):
        return value
    if depth > max_depth:
        return CLIPPED.format(depth=max_depth)
    if isinstance(value, dict):
        return {k: _clip(v, depth + 1, max_depth) for k, v in value.items()}
    return [_clip(v, depth + 1, max_depth) for v in value]


_SCALARS = (str, int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)


def plain(value: Any, *, _depth: int = 0) -> Any:
    """`value` with python-telegram-bot's objects (a TelegramObject: InlineKeyboardMarkup,
    MessageEntity, ...) turned into the JSON they stand for (`to_dict()`), at any place in
    dicts, lists and tuples, so a caller may pass them wherever a Bot API parameter takes
    one. Anything else is returned as it is, for the payload's checks to accept or refuse;
    a payload without such objects comes back unchanged (the same object)."""
    if isinstance(value, _SCALARS) or _depth > MAX_JSON_DEPTH:
        return value
    if isinstance(value, dict):
        # Every reply's payload ({"text": ...}): nothing to walk into.
        if all(type(v) in _SCALAR_TYPES for v in value.values()):
            return value
        converted = {k: plain(v, _depth=_depth + 1) for k, v in value.items()}
        return value if all(converted[k] is v for k, v in value.items()) else converted
    if isinstance(value, list | tuple):
        items = [plain(v, _depth=_depth + 1) for v in value]
        return value if isinstance(value, list) and all(a is b for a, b in zip(items, value, strict=True)) else items
    from telegram import TelegramObject

    if isinstance(value, TelegramObject):
        return value.to_dict()
    return value


def pretty_json(value: Any) -> str:
    """Stored JSON as the admin shows it (read-only): indented, non-ASCII as it is, clipped
    below MAX_JSON_DEPTH. A value JSON cannot spell (none should be stored) shows as text."""
    import json

    return json.dumps(clip(value), indent=2, ensure_ascii=False, default=str)
