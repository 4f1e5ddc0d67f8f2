"""Telegram's flood limits, shared by every worker on every host through Redis.

A bot's sends are paced by slots one interval apart (_RESERVE_LUA) and counted in a window
from the moment each takes its slot until a second after its answer (_TAKE_LUA), both on
Redis's clock; a chat's own limit is a gate key (1/s) or a moving window from `limits` (a
group's 20/min). A 429's retry_after pauses the whole bot (flood control is per bot)
through a key with a TTL, which wins over the limiter's own accounting.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cache

import limits.errors
import redis
from django.conf import settings
from limits import parse
from limits.storage import Storage, storage_from_string
from limits.strategies import MovingWindowRateLimiter

from core import connections
from core.connections import redis_ssl_options
from core.ids import random_id
from outbox import policy

logger = logging.getLogger(__name__)


@cache
def _storage() -> Storage:
    return storage_from_string(
        settings.REDIS_URL,
        key_prefix=f"{settings.DOVECOTE_REDIS_PREFIX}dovecote-limits",
        **redis_ssl_options(settings.REDIS_URL, settings.REDIS_SSL_CERT_REQS),
    )


@cache
def _limiter() -> MovingWindowRateLimiter:
    return MovingWindowRateLimiter(_storage())


# Redis holds the limiter: when it does not answer, no message may go (the limit could not be
# kept), and none may be left claimed (it would wait out its lease).
LIMITER_ERRORS = (redis.RedisError, limits.errors.StorageError)


redis_client = connections.shared_redis


def _pause_key(bot_id: int) -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:flood:{bot_id}"


def pause_bot(bot_id: int, seconds: float) -> None:
    """Telegram said retry_after: nothing of this bot goes out for that long."""
    until = time.time() + seconds
    # Keep the later of two pauses: two workers may both meet a 429.
    key = _pause_key(bot_id)
    current = redis_client().get(key)
    if current is None or float(current) < until:
        redis_client().set(key, repr(until), px=max(1, int(seconds * 1000)))


def bot_paused_for(bot_id: int) -> float:
    """Seconds left of the bot's flood-control pause (0 when none)."""
    value = redis_client().get(_pause_key(bot_id))
    until = float(value) if value is not None else 0.0
    return max(0.0, until - time.time())


def chat_limit_for(chat_id: int) -> str:
    # Telegram: about 1 message/s in a private chat, 20/min in a group (negative ids).
    return settings.DOVECOTE_GROUP_CHAT_RATE if chat_id < 0 else settings.DOVECOTE_PRIVATE_CHAT_RATE


# The slots come a little slower than the bot's rate, so that sends keeping to their slots
# leave room in its window (below) for the time a request spends on the way.
PACING = 0.96
# A chat's or a group's moving window (whole seconds, from `limits`) is waited out this much
# longer: its last request may have reached Telegram late.
WINDOW_MARGIN_SECONDS = 0.05
# A send whose bot's window has room again this soon waits for it where it is.
WINDOW_WAIT_IN_PLACE_SECONDS = 0.1
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
    kind, seconds = _reserve_script()(keys=[_pause_key(bot_id), _slot_key(bot_id)], args=[interval, horizon])
    return kind.decode() if isinstance(kind, bytes) else kind, float(seconds)


# `reserve_slot` for n sends at once (a drain's batch): the k slots that fit within
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
    k, first = _reserve_many_script()(keys=[_pause_key(bot_id), _slot_key(bot_id)], args=[interval, horizon, n])
    return [float(first) + i * interval for i in range(int(k))]


# The bot's window. Telegram counts a message in every sliding second that holds its
# arrival, and a request arrives some time after its send took a slot here and before its
# answer came back: not equally late every time (two commits, a busy core, a first
# connection come in between), so requests let go evenly can arrive bunched, and a second
# with one too many is a 429 that holds the whole bot. So each send is an entry from the
# moment it takes its slot until a second after its answer came: at most `rate` entries at
# once means at most `rate` arrivals in any second, however late each one arrived. An entry
# whose answer never comes (its process died) stays for `_longest_wait()`. A private chat's
# gate is held the same way. Redis's clock; a sorted set of entries scored by when each one
# leaves the window; a 429's pause and the chat's gate are checked in the same call.
_TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if ARGV[1] == '1' then
  local paused = redis.call('GET', KEYS[1])
  if paused and tonumber(paused) > now then return {'paused', tostring(tonumber(paused) - now)} end
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[2]) then
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  return {'full', tostring(tonumber(first[2]) - now)}
end
local longest = tonumber(ARGV[4])
if KEYS[3] and not redis.call('SET', KEYS[3], '1', 'NX', 'PX', math.ceil(longest * 1000) + tonumber(ARGV[5])) then
  -- held longer than a period: a send still on the way; look again in a period
  return {'chat', tostring(math.min(math.max(redis.call('PTTL', KEYS[3]), 10), tonumber(ARGV[5])) / 1000)}
end
redis.call('ZADD', KEYS[2], string.format('%.6f', now + 1 + longest), ARGV[3])
redis.call('PEXPIRE', KEYS[2], math.ceil((longest + 2) * 1000))
return {'go', '0'}
"""
# The answers came: each entry leaves a second from now (its chat's gate a period from
# now); or, ARGV[1] = '0', the requests never went: entries and gates go at once.
_LEAVE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local sent = ARGV[1] == '1'
local n = tonumber(ARGV[2])
for i = 1, n do
  if sent then
    redis.call('ZADD', KEYS[1], 'XX', string.format('%.6f', now + 1), ARGV[2 + i])
  else
    redis.call('ZREM', KEYS[1], ARGV[2 + i])
  end
end
for i = 2, #KEYS do
  if sent then
    redis.call('SET', KEYS[i], '1', 'PX', tonumber(ARGV[2 + n + i - 1]))
  else
    redis.call('DEL', KEYS[i])
  end
end
return 1
"""


def _longest_wait() -> float:
    """How long an entry whose answer never comes stays: the longest a sender waits for an
    answer, or the send's lease if shorter - past it the sweeper takes the send for lost,
    and its message may be sent again."""
    return min(policy.answer_wait_seconds(), float(settings.DOVECOTE_SEND_LEASE_SECONDS))


@cache
def _scripts():
    client = redis_client()
    return client.register_script(_TAKE_LUA), client.register_script(_LEAVE_LUA)


def _window_key(bot_id: int) -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:window:{bot_id}"


@dataclass(frozen=True)
class Entry:
    """A send's place in its bot's window (and its private chat's gate, with the chat's
    period in ms), from its slot until `leave` after the answer."""

    bot_id: int
    id: str
    chat_gate: tuple[str, int] | None = None


def _take(
    bot_id: int, rate: int, gate: tuple[str, int] | None, *, check_pause: bool
) -> tuple[str, float, Entry | None]:
    """Enter a send in the bot's window and take its chat's gate: ("go", 0, entry), or,
    taking nothing, ("paused" | "full" | "chat", seconds to wait, None)."""
    entry = Entry(bot_id, random_id(), gate)
    keys = [_pause_key(bot_id), _window_key(bot_id)] + ([gate[0]] if gate else [])
    args = ["1" if check_pause else "0", max(int(rate), 1), entry.id, _longest_wait(), gate[1] if gate else 0]
    kind, seconds = _scripts()[0](keys=keys, args=args)
    kind = kind.decode() if isinstance(kind, bytes) else kind
    return kind, float(seconds), entry if kind == "go" else None


def leave(entries: list[Entry], *, sent: bool = True) -> None:
    """The sends' answers came (or their wait ended): each leaves its bot's window, and
    frees its chat's gate, a second (the chat's period) from now. `sent=False`: the requests
    never went out; they leave at once. Never raises: an entry left behind only narrows the
    window until it expires."""
    by_bot: dict[int, list[Entry]] = {}
    for entry in entries:
        by_bot.setdefault(entry.bot_id, []).append(entry)
    for bot_id, mine in by_bot.items():
        try:
            _leave(bot_id, mine, sent=sent)
        except LIMITER_ERRORS as exc:
            logger.warning("bot %s: rate limiter unreachable as %d send(s) left its window: %s", bot_id, len(mine), exc)


def _leave(bot_id: int, entries: list[Entry], *, sent: bool) -> None:
    gates = [e.chat_gate for e in entries if e.chat_gate]
    keys = [_window_key(bot_id)] + [g[0] for g in gates]
    args = ["1" if sent else "0", len(entries), *[e.id for e in entries], *[g[1] for g in gates]]
    _scripts()[1](keys=keys, args=args)


@dataclass(frozen=True)
class Wait:
    """Seconds to wait before trying again (0: go now), and whether a slot is held for then."""

    seconds: float = 0.0
    slot_reserved: bool = False
    beyond_horizon: bool = False
    # Given with a go: the send's place in the bot's window, for `leave` after its answer.
    entry: Entry | None = None


GO = Wait()


def acquire(
    *, bot_id: int, bot_rate: int, chat_id: int | None, slot_reserved: bool = False, horizon: float | None = None
) -> Wait:
    """Take a send slot for this bot and chat, or say how long to wait.

    `horizon`: reserve a later slot only this far ahead (default: a broker countdown); with
    SLOT_TOLERANCE_SECONDS, only a slot that is free now, else nothing is reserved.

    A go holds an entry in the bot's window (and the chat's gate): the caller calls `leave`
    with it once the answer came, or with `sent=False` if it did not send after all.

    Waiting is not an attempt: the caller reschedules the send and frees its worker slot.
    A Telegram 429 pause is honoured even with the limiter switched off.
    """
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        paused = bot_paused_for(bot_id)
        return Wait(paused) if paused > 0 else GO
    limiter = _limiter()
    chat_item = parse(chat_limit_for(chat_id)) if chat_id is not None else None
    chat_key = f"chat:{bot_id}:{chat_id}"
    gate = _chat_gate(chat_item, chat_key) if chat_item is not None else None
    # Test the chat first, so that a busy chat does not use up a slot of the whole bot (with
    # its slot already held, the window's script takes the chat's gate or says how long).
    if (
        chat_item is not None
        and not (slot_reserved and gate)
        and (wait := _chat_test(limiter, chat_item, chat_key)) > 0
    ):
        return Wait(wait)
    if not slot_reserved:
        ahead = policy.MAX_BROKER_COUNTDOWN_SECONDS if horizon is None else horizon
        kind, seconds = reserve_slot(bot_id, bot_rate, horizon=ahead)
        if kind == "paused":
            return Wait(seconds)
        if kind == "full":
            return Wait(seconds, beyond_horizon=True)
        if seconds > SLOT_TOLERANCE_SECONDS:
            return Wait(seconds, slot_reserved=True)
    kind, seconds, entry = _take(bot_id, bot_rate, gate, check_pause=slot_reserved)
    while kind == "full" and seconds <= WINDOW_WAIT_IN_PLACE_SECONDS:
        # An entry leaves the window this soon: the send keeps its slot rather than go to
        # the back of the queue for a new one.
        time.sleep(seconds)
        kind, seconds, entry = _take(bot_id, bot_rate, gate, check_pause=True)
    if entry is None:
        return Wait(max(0.001, seconds))
    if chat_item is not None and gate is None and (wait := _chat_hit(limiter, chat_item, chat_key)) > 0:
        leave([entry], sent=False)
        return Wait(wait)
    return Wait(entry=entry)


# `chat_waits`, `reserve_slots` and, for each send whose slot is now, `_take`, in one call
# (a worker sending what it just wrote): the same keys and the same order of checks - the
# 429 pause, then each chat's gate before it spends a slot of the bot, then the bot's slots
# one interval apart, then its window - so the answers are those of the three calls made
# one after another, with two round trips fewer. Per send: {kind, seconds} with kind 'go'
# (in the window, its gate taken), 'slot' (a later slot reserved), 'full' (its slot is now
# but the window is full), 'chat' (its chat is busy), 'none' (no slot within the horizon).
#
# Bulk sends (ARGV[6] = '1', a broadcast's) come after everyone else: they take slots only
# while none is booked ahead - a booked slot is a reply waiting for it - and answer 'busy'
# for all otherwise; each one's window entry is taken with its slot, so that all of them
# may go at once (an entry taken early only holds the window longer), and a full window
# books nothing.
_TAKE_NOW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local paused = redis.call('GET', KEYS[1])
if paused and tonumber(paused) > now then return {'paused', tostring(tonumber(paused) - now)} end
local interval, horizon = tonumber(ARGV[1]), tonumber(ARGV[2])
local rate, longest, tolerance = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local bulk = ARGV[6] == '1'
local nxt = tonumber(redis.call('GET', KEYS[2]) or '0')
if bulk and nxt > now + tolerance then return {'busy', tostring(nxt - now)} end
if nxt < now then nxt = now end
local reserved, entered = false, false
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local count = redis.call('ZCARD', KEYS[3])
local out, gate = {}, 3
for i = 0, tonumber(ARGV[7]) - 1 do
  local period, id = tonumber(ARGV[8 + 2 * i]), ARGV[9 + 2 * i]
  local key = nil
  if period > 0 then gate = gate + 1; key = KEYS[gate] end
  local left = key and redis.call('PTTL', key) or -2
  local delay = nxt - now
  if left > 0 then
    out[#out + 1] = 'chat'; out[#out + 1] = tostring(math.min(left, period) / 1000)
  elseif delay > horizon then
    out[#out + 1] = 'none'; out[#out + 1] = tostring(delay)
  elseif bulk and count >= rate then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    out[#out + 1] = 'full'; out[#out + 1] = tostring(tonumber(first[2]) - now)
  else
    nxt = nxt + interval
    reserved = true
    if delay > tolerance and not bulk then
      out[#out + 1] = 'slot'; out[#out + 1] = tostring(delay)
    elseif count >= rate then
      local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
      out[#out + 1] = 'full'; out[#out + 1] = tostring(tonumber(first[2]) - now)
    else
      if key then redis.call('SET', key, '1', 'PX', math.ceil(longest * 1000) + period) end
      redis.call('ZADD', KEYS[3], string.format('%.6f', now + 1 + longest), id)
      count = count + 1
      entered = true
      out[#out + 1] = 'go'; out[#out + 1] = '0'
    end
  end
end
if reserved then redis.call('SET', KEYS[2], tostring(nxt), 'PX', math.ceil((nxt - now) * 1000) + 1000) end
if entered then redis.call('PEXPIRE', KEYS[3], math.ceil((longest + 2) * 1000)) end
return out
"""


@cache
def _take_now_script():
    return redis_client().register_script(_TAKE_NOW_LUA)


@dataclass(frozen=True)
class Turn:
    """A send's turn from `take_now`: "go" (with its window entry), "slot" (come back in
    `seconds`, the slot is held), "full" (its slot is now, the bot's window is not: take it
    with `acquire(slot_reserved=True)`), "chat" (its chat is busy for `seconds`), "none" (no
    slot within the horizon) or "paused" (a 429 pause: `seconds` left)."""

    kind: str
    seconds: float = 0.0
    entry: Entry | None = None


def take_now(
    bot_id: int, rate: int, chat_ids: list[int | None], *, horizon: float, bulk: bool = False
) -> list[Turn] | None:
    """Each send's turn, in one round trip: what `chat_waits`, `reserve_slots` and a send's
    `acquire` at its slot answer one after another. None when that takes the calls one by
    one: with the limiter off, or for a chat with a moving window (a group's 20/min, kept
    by `limits`).

    `bulk` (a broadcast's sends): only while no slot of the bot is booked ahead, else all
    "busy" for the seconds until the last booked one; the slots within `horizon` are booked
    with their window entries, all "go" at once; a full window is "full", booking nothing."""
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        return None
    if not chat_ids:
        return []  # nothing left to send (another worker claimed the batch first)
    gates: list[tuple[str, int] | None] = []
    for chat_id in chat_ids:
        gate = _chat_gate(parse(chat_limit_for(chat_id)), f"chat:{bot_id}:{chat_id}") if chat_id is not None else None
        if chat_id is not None and gate is None:
            return None
        gates.append(gate)
    entries = [Entry(bot_id, random_id(), gate) for gate in gates]
    keys = [_pause_key(bot_id), _slot_key(bot_id), _window_key(bot_id)] + [g[0] for g in gates if g]
    args: list[object] = [1.0 / max(rate * PACING, 0.001), horizon, max(int(rate), 1), _longest_wait()]
    args += [SLOT_TOLERANCE_SECONDS, "1" if bulk else "0", len(entries)]
    for entry in entries:
        args += [entry.chat_gate[1] if entry.chat_gate else 0, entry.id]
    answer = [a.decode() if isinstance(a, bytes) else a for a in _take_now_script()(keys=keys, args=args)]
    if answer[0] in ("paused", "busy"):
        return [Turn(answer[0], float(answer[1]))] * len(entries)
    return [
        Turn(kind, float(seconds), entry if kind == "go" else None)
        for kind, seconds, entry in zip(answer[::2], answer[1::2], entries, strict=True)
    ]


# How long until a bulk send may take a slot of the bot (0: now): a 429's pause, the last
# slot booked ahead (replies waiting, or the bulk sends' own last batch) and a full window.
_BULK_WAIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local wait = 0
local paused = redis.call('GET', KEYS[1])
if paused then wait = math.max(wait, tonumber(paused) - now) end
local nxt = redis.call('GET', KEYS[2])
if nxt then wait = math.max(wait, tonumber(nxt) - now) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[1]) then
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  wait = math.max(wait, tonumber(first[2]) - now)
end
return tostring(wait)
"""


@cache
def _bulk_wait_script():
    return redis_client().register_script(_BULK_WAIT_LUA)


def bulk_wait(bot_id: int, rate: int) -> float:
    """Seconds until a bulk send of this bot may take a slot (`take_now(bulk=True)`), read
    in one round trip without taking anything: a broadcast's drain looks before it claims."""
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        return bot_paused_for(bot_id)
    keys = [_pause_key(bot_id), _slot_key(bot_id), _window_key(bot_id)]
    wait = float(_bulk_wait_script()(keys=keys, args=[max(int(rate), 1)], client=redis_client()))
    return wait if wait > SLOT_TOLERANCE_SECONDS else 0.0


def chat_wait(*, bot_id: int, chat_id: int | None) -> float:
    """Seconds until this chat may take a message (0: now), without taking it: the drain
    leaves a busy chat's message waiting before it spends a slot of the whole bot on it."""
    return chat_waits(bot_id=bot_id, chat_ids=[chat_id])[0]


def chat_waits(*, bot_id: int, chat_ids: list[int | None]) -> list[float]:
    """`chat_wait` for each of these chats (a drain's batch): the private chats' gates are
    read in one round trip, not one each."""
    if not settings.DOVECOTE_RATE_LIMITS_ENABLED:
        return [0.0] * len(chat_ids)
    waits = [0.0] * len(chat_ids)
    gated: list[tuple[int, tuple[str, int]]] = []
    limiter = _limiter()
    for n, chat_id in enumerate(chat_ids):
        if chat_id is None:
            continue
        item, key = parse(chat_limit_for(chat_id)), f"chat:{bot_id}:{chat_id}"
        gate = _chat_gate(item, key)
        if gate is None:
            waits[n] = _chat_test(limiter, item, key)
        else:
            gated.append((n, gate))
    if gated:
        pipe = redis_client().pipeline(transaction=False)
        for _, (name, _period) in gated:
            pipe.pttl(name)
        for (n, (_name, period)), left in zip(gated, pipe.execute(), strict=True):
            waits[n] = _gate_wait(left, period)
    return waits


# A chat allowed one message per period (a private chat: 1/s) is gated by a Redis key, held
# as a send's window entry is (_TAKE_LUA): from its slot until a period after its answer.
# Other limits (a group's 20/min) keep the moving window.
def _chat_gate(item: object, key: str) -> tuple[str, int] | None:
    """The gate's key and period in ms, for a one-per-period limit; else None."""
    if getattr(item, "amount", 0) != 1:
        return None
    period = int(item.get_expiry() * 1000)  # type: ignore[attr-defined]
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:chat-gate:{key}", period


def _gate_wait(left_ms: int, period_ms: int) -> float:
    """Seconds until a chat's gate is free, from its key's PTTL (negative: no gate). Held
    longer than a period: a send still on the way; look again in a period."""
    left = min(left_ms, period_ms)
    return left / 1000 if left > 0 else 0.0


def _chat_test(limiter: MovingWindowRateLimiter, item: object, key: str) -> float:
    gate = _chat_gate(item, key)
    if gate is not None:
        return _gate_wait(redis_client().pttl(gate[0]), gate[1])
    return 0.0 if limiter.test(item, key) else _wait(limiter, item, key)  # type: ignore[arg-type]


def _chat_hit(limiter: MovingWindowRateLimiter, item: object, key: str) -> float:
    """Take the chat's slot in its moving window (a group's): 0, or how long until it is free."""
    return 0.0 if limiter.hit(item, key) else _wait(limiter, item, key)  # type: ignore[arg-type]


def _wait(limiter: MovingWindowRateLimiter, item: object, key: str) -> float:
    stats = limiter.get_window_stats(item, key)  # type: ignore[arg-type]
    # A little past the window's end: the last request may have reached Telegram late.
    return max(0.01, stats.reset_time - time.time()) + WINDOW_MARGIN_SECONDS


def reset() -> None:
    """Forget all limiter state (tests, and after an operator changes limits)."""
    _storage().reset()
    prefix = settings.DOVECOTE_REDIS_PREFIX
    for pattern in (f"{prefix}dovecote:flood:*", f"{prefix}dovecote:slot:*", f"{prefix}dovecote:window:*"):
        for key in redis_client().scan_iter(pattern):
            redis_client().delete(key)
