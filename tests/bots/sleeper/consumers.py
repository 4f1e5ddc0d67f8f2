"""`sleeper`: takes longer than its one-second time limit on every message."""

from __future__ import annotations

import time

from bots.registry import ConsumerContext, consumer


@consumer("sleeper", update_types=["message"], max_attempts=2, backoff=(0.5,), timeout=1.0)
def sleeper(ctx: ConsumerContext) -> str:
    time.sleep(30)  # far past the time limit and the lease: only the soft limit ends it in time
    return "woke-up"
