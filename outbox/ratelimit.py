"""Telegram's flood limits, shared by every worker on every host through Redis.

The moving-window limiter comes from `limits` (measured here: 4 processes on one Redis key
for 5 s at 30/s allowed exactly 150). A 429's retry_after pauses the whole bot
(flood control is per bot) through a key with a TTL, which wins over the limiter's own
accounting. Without REDIS_URL (the demo) the state is per process.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from functools import cache

from django.conf import settings
from limits import RateLimitItemPerSecond, parse
from limits.storage import MemoryStorage, Storage, storage_from_string
from limits.strategies import MovingWindowRateLimiter

from outbox import policy
from project import connections
from project.connections import redis_ssl_options


@cache
def _storage() -> Storage:
    if settings.REDIS_URL:
        return storage_from_string(
            settings.REDIS_URL,
            key_prefix=f"{settings.DOVECOTE_REDIS_PREFIX}dovecote-limits",
            **redis_ssl_options(settings.REDIS_URL, settings.REDIS_SSL_CERT_REQS),
        )
    return MemoryStorage()


@cache
def _limiter() -> MovingWindowRateLimiter:
    return MovingWindowRateLimiter(_storage())


@cache
def redis_client():
    """This process's client for Dovecote's own Redis keys (the limiter's, the drain's)."""
    return connections.redis_client()


_local_pauses: dict[int, float] = {}
_local_lock = threading.Lock()


def _pause_key(bot_id: int) -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:flood:{bot_id}"


def pause_bot(bot_id: int, seconds: float) -> None:
    """Telegram said retry_after: nothing of this bot goes out for that long."""
    until = time.time() + seconds
    if settings.REDIS_URL:
        # Keep the later of two pauses: two workers may both meet a 429.
        key = _pause_key(bot_id)
        current = redis_client().get(key)
        if current is None or float(current) < until:
            redis_client().set(key, repr(until), px=max(1, int(seconds * 1000)))
    else:
        with _local_lock:
            _local_pauses[bot_id] = max(until, _local_pauses.get(bot_id, 0.0))


def bot_paused_for(bot_id: int) -> float:
    """Seconds left of the bot's flood-control pause (0 when none)."""
    if settings.REDIS_URL:
        value = redis_client().get(_pause_key(bot_id))
        until = float(value) if value is not None else 0.0
    else:
        until = _local_pauses.get(bot_id, 0.0)
    return max(0.0, until - time.time())


def chat_limit_for(chat_id: int) -> str:
    # Telegram: about 1 message/s in a private chat, 20/min in a group (negative ids).
    return settings.DOVECOTE_GROUP_CHAT_RATE if chat_id < 0 else settings.DOVECOTE_PRIVATE_CHAT_RATE


# Slots are handed out a little below the configured rate: the request reaches Telegram a
# few milliseconds after the slot is taken, and that jitter must not add up to one message
# too many in Telegram's own window. At 0.93 a request may arrive ~65 ms late (at 5/s and
# at 100/s alike) before Telegram could count one message too many in a second.
PACING = 0.93
WINDOW_PACING = (1 + PACING) / 2
WINDOW_MARGIN_SECONDS = 0.05
# A reserved slot this close is taken at once rather than rescheduled.
SLOT_TOLERANCE_SECONDS = 0.003

# Schedules waiters one slot apart (the "virtual scheduling" form of GCRA) so that a queue
# of N deferred sends wakes up spread over N / rate seconds instead of all at once at the
# next window boundary. It only decides *when* to come back; the moving window from
# `limits` below remains the authority on whether a request may go out.
_RESERVE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local paused = redis.call('GET', KEYS[1])
if paused then
  local left = tonumber(paused) - now
  if left > 0 then return {'paused', tostring(left)} end
end
local nxt = tonumber(redis.call('GET', KEYS[2]) or '0')
if nxt < now then nxt = now end
local delay = nxt - now
if delay > tonumber(ARGV[2]) then return {'full', tostring(delay)} end
local interval = tonumber(ARGV[1])
redis.call('SET', KEYS[2], tostring(nxt + interval), 'PX', math.ceil((delay + interval) * 1000) + 1000)
return {'reserved', tostring(delay)}
"""

_local_slots: dict[int, float] = {}


@cache
def _reserve_script():
    return redis_client().register_script(_RESERVE_LUA)


def _slot_key(bot_id: int) -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:slot:{bot_id}"


def reserve_slot(bot_id: int, rate: float, *, horizon: float) -> tuple[str, float]:
    """Reserve this bot's next send slot. Returns (kind, seconds): ("reserved", d) - come
    back in d seconds and send; ("paused", d) - a 429 pause; ("full", d) - nothing reserved,
    the queue already reaches d seconds ahead (beyond `horizon`)."""
    interval = 1.0 / max(rate * PACING, 0.001)
    if settings.REDIS_URL:
        kind, seconds = _reserve_script()(keys=[_pause_key(bot_id), _slot_key(bot_id)], args=[interval, horizon])
        return kind.decode() if isinstance(kind, bytes) else kind, float(seconds)
    now = time.time()
    with _local_lock:
        paused = _local_pauses.get(bot_id, 0.0) - now
        if paused > 0:
            return "paused", paused
        nxt = max(now, _local_slots.get(bot_id, 0.0))
        if nxt - now > horizon:
            return "full", nxt - now
        _local_slots[bot_id] = nxt + interval
        return "reserved", nxt - now


# `reserve_slot` for n sends at once (a broadcast's fan-out): the k slots that fit within
# the horizon, one interval apart; k = 0 when paused or already full.
_RESERVE_MANY_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local paused = redis.call('GET', KEYS[1])
if paused and tonumber(paused) - now > 0 then return {'0', '0'} end
local nxt = tonumber(redis.call('GET', KEYS[2]) or '0')
if nxt < now then nxt = now end
local delay = nxt - now
local interval = tonumber(ARGV[1])
local horizon = tonumber(ARGV[2])
if delay > horizon then return {'0', '0'} end
local k = math.min(tonumber(ARGV[3]), math.floor((horizon - delay) / interval) + 1)
local last = delay + k * interval
redis.call('SET', KEYS[2], tostring(nxt + k * interval), 'PX', math.ceil(last * 1000) + 1000)
return {tostring(k), tostring(delay)}
"""


@cache
def _reserve_many_script():
    return redis_client().register_script(_RESERVE_MANY_LUA)


def reserve_slots(bot_id: int, rate: float, n: int, *, horizon: float) -> list[float]:
    """Reserve up to n of this bot's next send slots at once; returns the delay (seconds
    from now) of each slot reserved, in order: fewer than n when the queue reaches past
    `horizon`, none during a 429 pause. Each send then comes back at its slot with
    `slot_reserved`, instead of every one of them asking for a slot first."""
    interval = 1.0 / max(rate * PACING, 0.001)
    if n <= 0:
        return []
    if settings.REDIS_URL:
        k, first = _reserve_many_script()(keys=[_pause_key(bot_id), _slot_key(bot_id)], args=[interval, horizon, n])
        return [float(first) + i * interval for i in range(int(k))]
    now = time.time()
    with _local_lock:
        if _local_pauses.get(bot_id, 0.0) > now:
            return []
        nxt = max(now, _local_slots.get(bot_id, 0.0))
        if nxt - now > horizon:
            return []
        k = min(n, int((horizon - (nxt - now)) / interval) + 1)
        _local_slots[bot_id] = nxt + k * interval
        return [nxt - now + i * interval for i in range(k)]


@dataclass(frozen=True)
class Wait:
    """Seconds to wait before trying again (0: go now), and whether a slot is held for then."""

    seconds: float = 0.0
    slot_reserved: bool = False
    beyond_horizon: bool = False


GO = Wait()


def acquire(
    *, bot_id: int, bot_rate: int, chat_id: int | None, slot_reserved: bool = False, horizon: float | None = None
) -> Wait:
    """Take a send slot for this bot and chat, or say how long to wait.

    `horizon`: reserve a later slot only this far ahead (default: a broker countdown); with
    SLOT_TOLERANCE_SECONDS, only a slot that is free now, else nothing is reserved.

    Waiting is not an attempt: the caller reschedules the send and frees its worker slot.
    A Telegram 429 pause is honoured even with the limiter switched off.
    """
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        paused = bot_paused_for(bot_id)
        return Wait(paused) if paused > 0 else GO
    limiter = _limiter()
    chat_item = parse(chat_limit_for(chat_id)) if chat_id is not None else None
    chat_key = f"chat:{bot_id}:{chat_id}"
    # Test the chat first, so that a busy chat does not use up a slot of the whole bot.
    if chat_item is not None and (wait := _chat_test(limiter, chat_item, chat_key)) > 0:
        return Wait(wait)
    if slot_reserved:
        paused = bot_paused_for(bot_id)
        if paused > 0:
            return Wait(paused)
    else:
        ahead = policy.MAX_BROKER_COUNTDOWN_SECONDS if horizon is None else horizon
        kind, seconds = reserve_slot(bot_id, bot_rate, horizon=ahead)
        if kind == "paused":
            return Wait(seconds)
        if kind == "full":
            return Wait(seconds, beyond_horizon=True)
        if seconds > SLOT_TOLERANCE_SECONDS:
            return Wait(seconds, slot_reserved=True)
    # The window stops short of the full rate, between it and the slots' pace: sends that
    # fall behind their slots (a busy worker) run back to back, and a window filled to the
    # full rate turned the requests' jitter into 429s (bench/broadcast.py); one below the
    # slots' pace would refuse sends that keep to their slots.
    bot_item = RateLimitItemPerSecond(max(math.ceil(bot_rate * PACING), int(bot_rate * WINDOW_PACING), 1))
    bot_key = f"bot:{bot_id}"
    if not limiter.hit(bot_item, bot_key):
        return Wait(_wait(limiter, bot_item, bot_key))
    if chat_item is not None and (wait := _chat_hit(limiter, chat_item, chat_key)) > 0:
        return Wait(wait)
    return GO


def chat_wait(*, bot_id: int, chat_id: int | None) -> float:
    """Seconds until this chat may take a message (0: now), without taking it: the drain
    leaves a busy chat's message waiting before it spends a slot of the whole bot on it."""
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED or chat_id is None:
        return 0.0
    return _chat_test(_limiter(), parse(chat_limit_for(chat_id)), f"chat:{bot_id}:{chat_id}")


# A chat allowed one message per period (a private chat: 1/s) is gated by a Redis key that
# lives for the period and this margin. Telegram counts a request when it arrives, a few
# milliseconds after the limiter let it go, and two sends let go exactly a second apart
# can arrive closer than that: a 429 that pauses the whole bot. Other limits (a group's
# 20/min) keep the moving window.
CHAT_GATE_MARGIN_SECONDS = 0.04


def _chat_gate(item: object, key: str) -> tuple[str, int] | None:
    """The gate's key and lifetime in ms, for a one-per-period limit with Redis; else None."""
    if not settings.REDIS_URL or getattr(item, "amount", 0) != 1:
        return None
    lifetime = int((item.get_expiry() + CHAT_GATE_MARGIN_SECONDS) * 1000)  # type: ignore[attr-defined]
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:chat-gate:{key}", lifetime


def _chat_test(limiter: MovingWindowRateLimiter, item: object, key: str) -> float:
    gate = _chat_gate(item, key)
    if gate is not None:
        left = redis_client().pttl(gate[0])
        return left / 1000 if left > 0 else 0.0
    return 0.0 if limiter.test(item, key) else _wait(limiter, item, key)  # type: ignore[arg-type]


def _chat_hit(limiter: MovingWindowRateLimiter, item: object, key: str) -> float:
    """Take the chat's message slot: 0, or how long until it is free."""
    gate = _chat_gate(item, key)
    if gate is not None:
        if redis_client().set(gate[0], b"1", nx=True, px=gate[1]):
            return 0.0
        return max(0.01, redis_client().pttl(gate[0]) / 1000)
    return 0.0 if limiter.hit(item, key) else _wait(limiter, item, key)  # type: ignore[arg-type]


def _wait(limiter: MovingWindowRateLimiter, item: object, key: str) -> float:
    stats = limiter.get_window_stats(item, key)  # type: ignore[arg-type]
    # A little past the window's end: the last request may have reached Telegram late.
    return max(0.01, stats.reset_time - time.time()) + WINDOW_MARGIN_SECONDS


def reset() -> None:
    """Forget all limiter state (tests, and after an operator changes limits)."""
    _storage().reset()
    with _local_lock:
        _local_pauses.clear()
        _local_slots.clear()
    if settings.REDIS_URL:
        prefix = settings.DOVECOTE_REDIS_PREFIX
        for pattern in (f"{prefix}dovecote:flood:*", f"{prefix}dovecote:slot:*"):
            for key in redis_client().scan_iter(pattern):
                redis_client().delete(key)
