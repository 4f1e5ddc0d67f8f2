"""Publishing tasks to the broker without ever failing the caller.

Every row is committed before its task is published, so a lost publish only delays work
until the sweeper redispatches it. When the broker is down, each publish still costs the
client's connection retries (about 2 s with redis-py); after one failure this process skips
publishing for a few seconds instead, so a webhook keeps answering 200 in milliseconds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

BROKER_DOWN_BACKOFF_SECONDS = 5.0

_lock = threading.Lock()
_skip_until = 0.0


def publish(
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    countdown: float | None = None,
    what: str = "task",
    **options: Any,
) -> bool:
    """apply_async (with `options`, e.g. time limits), or False (logged) when the broker is
    unreachable. Never raises."""
    global _skip_until
    if time.monotonic() < _skip_until:
        return False
    try:
        task.apply_async(args, kwargs or {}, countdown=countdown or None, retry=False, **options)
    except Exception:  # noqa: BLE001 - any broker failure; the sweeper recovers
        with _lock:
            first = time.monotonic() >= _skip_until
            _skip_until = time.monotonic() + BROKER_DOWN_BACKOFF_SECONDS
        from core.workers import outage_watch

        outage_watch.note("a publish failed")  # resumed once the broker is back
        if first:
            logger.warning(
                "broker unreachable publishing %s; skipping publishes for %.0fs, the sweeper will dispatch",
                what,
                BROKER_DOWN_BACKOFF_SECONDS,
                exc_info=True,
            )
        return False
    return True


def reset() -> None:
    global _skip_until
    _skip_until = 0.0
