"""Who sees payloads in full: the one rule every admin page, the story and the export apply.

The permission is reconciliation's (`view_payload`), named here rather than imported, because
outbox's own admin (error texts, Telegram's results) applies it too.
"""

from __future__ import annotations

from typing import Any

PAYLOAD_PERMISSION = "reconciliation.view_payload"


def can_view_payload(user: Any) -> bool:
    """Whether `user` sees what people wrote and who they are, unmasked."""
    return bool(user and user.has_perm(PAYLOAD_PERMISSION))
