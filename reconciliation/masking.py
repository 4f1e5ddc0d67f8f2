"""Payloads as a user may see them, clipped to a depth every renderer can walk; what is
masked, and for whom, is outbox.masking's rule."""

from __future__ import annotations

from typing import Any

from outbox.masking import can_view_payload, mask
from outbox.payloads import clip


def for_user(user: Any, value: Any) -> Any:
    """What `user` may see of a payload: in full with payload access, masked without it;
    clipped either way (templates' pprint and json.dumps recurse once per level)."""
    return shown(value, visible=can_view_payload(user))


def shown(value: Any, *, visible: bool) -> Any:
    """`value` in full (`visible`) or masked, clipped to MAX_JSON_DEPTH."""
    return clip(value if visible else mask(value))
