"""Masking of message text and personal fields for users without `reconciliation.view_payload`."""

from __future__ import annotations

from typing import Any

from outbox.masking import can_view_payload
from outbox.payloads import clip

PERSONAL_FIELDS = frozenset({"text", "caption", "phone_number", "first_name", "last_name", "username"})
MASK = "••• masked •••"


def mask(value: Any) -> Any:
    """The same JSON shape with message text and personal fields replaced, at any depth;
    levels past MAX_JSON_DEPTH are clipped first (this walk recurses)."""
    return _mask(clip(value))


def _mask(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (MASK if k in PERSONAL_FIELDS and v not in (None, "") else _mask(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v) for v in value]
    return value


def for_user(user: Any, value: Any) -> Any:
    """What `user` may see of a payload, clipped to a depth every renderer can walk."""
    return clip(value) if can_view_payload(user) else mask(value)
