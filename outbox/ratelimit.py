"""Telegram's flood limits, shared by every worker on every host through Redis.

The moving-window limiter comes from `limits` (measured here: 4 processes on one Redis key
for 5 s at 30/s allowed exactly 150). A 429's retry_after pauses the whole bot
(flood control is per bot) through a key with a TTL, which wins over the limiter's own
accounting. Without REDIS_URL (the demo) the state is per process.
"""

from __future__ import annotations

import threading
import time
from functools import cache

from django.conf import settings
from limits import RateLimitItemPerSecond, parse
from limits.storage import MemoryStorage, Storage, storage_from_string
from limits.strategies import MovingWindowRateLimiter


@cache
def _storage() -> Storage:
    if settings.REDIS_URL:
        return storage_from_string(settings.REDIS_URL, key_prefix="dovecote-limits")
    return MemoryStorage()


@cache
def _limiter() -> MovingWindowRateLimiter:
    return MovingWindowRateLimiter(_storage())


@cache
def _redis():  # noqa: ANN202 - redis.Redis, imported lazily
    import redis

    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


_local_pauses: dict[int, float] = {}
_local_lock = threading.Lock()


def _pause_key(bot_id: int) -> str:
    return f"dovecote:flood:{bot_id}"


def pause_bot(bot_id: int, seconds: float) -> None:
    """Telegram said retry_after: nothing of this bot goes out for that long."""
    until = time.time() + seconds
    if settings.REDIS_URL:
        # Keep the later of two pauses: two workers may both meet a 429.
        key = _pause_key(bot_id)
        current = _redis().get(key)
        if current is None or float(current) < until:
            _redis().set(key, repr(until), px=max(1, int(seconds * 1000)))
    else:
        with _local_lock:
            _local_pauses[bot_id] = max(until, _local_pauses.get(bot_id, 0.0))


def bot_paused_for(bot_id: int) -> float:
    """Seconds left of the bot's flood-control pause (0 when none)."""
    if settings.REDIS_URL:
        value = _redis().get(_pause_key(bot_id))
        until = float(value) if value is not None else 0.0
    else:
        until = _local_pauses.get(bot_id, 0.0)
    return max(0.0, until - time.time())


def chat_limit_for(chat_id: int) -> str:
    # Telegram: about 1 message/s in a private chat, 20/min in a group (negative ids).
    return settings.DOVECOTE_GROUP_CHAT_RATE if chat_id < 0 else settings.DOVECOTE_PRIVATE_CHAT_RATE


def acquire(*, bot_id: int, bot_rate: int, chat_id: int | None) -> float:
    """Take a send slot for this bot and chat. Returns 0.0 when taken, else seconds to wait.

    Waiting is not an attempt: the caller reschedules the send and frees its worker slot.
    """
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        return 0.0
    paused = bot_paused_for(bot_id)
    if paused > 0:
        return paused
    limiter = _limiter()
    bot_item = RateLimitItemPerSecond(max(1, bot_rate))
    bot_key = f"bot:{bot_id}"
    if not limiter.test(bot_item, bot_key):
        return _wait(limiter, bot_item, bot_key)
    if chat_id is not None:
        chat_item = parse(chat_limit_for(chat_id))
        chat_key = f"chat:{bot_id}:{chat_id}"
        if not limiter.hit(chat_item, chat_key):
            return _wait(limiter, chat_item, chat_key)
    if not limiter.hit(bot_item, bot_key):
        return _wait(limiter, bot_item, bot_key)
    return 0.0


def _wait(limiter: MovingWindowRateLimiter, item: object, key: str) -> float:
    stats = limiter.get_window_stats(item, key)  # type: ignore[arg-type]
    return max(0.01, stats.reset_time - time.time())


def reset() -> None:
    """Forget all limiter state (tests, and after an operator changes limits)."""
    _storage().reset()
    with _local_lock:
        _local_pauses.clear()
    if settings.REDIS_URL:
        for key in _redis().scan_iter("dovecote:flood:*"):
            _redis().delete(key)
