"""Who holds a claim: this process's worker id, written to a row's `lease_owner` by every
claim (outbound messages, consumer runs, effects)."""

from __future__ import annotations

import os
import socket


def worker_id() -> str:
    """host:pid of this process."""
    # Recomputed after fork: prefork children must not share their parent's id.
    return f"{socket.gethostname()}:{os.getpid()}"
