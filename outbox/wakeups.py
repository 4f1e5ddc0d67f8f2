"""Coalesced wake-ups: one Redis key per (kind, bot) says a task of that kind is queued or
running for the bot, so a burst of work publishes one task instead of one per item.

The protocol, the same for the outbox's drain and the inbox's router: whoever sets the key
(SET NX) publishes the task; everyone else trusts it. The running task renews the key as it
goes; when it finds nothing more to do it deletes the key and looks once more, so work
committed while the key was still held is never left without a task. A task lost with its
worker or its broker message stops renewing the key, which then expires (KEY_TTL_MS), and the
next wake-up, or the sweeper, publishes a new one. When Redis fails, `take` says so (None)
and the caller falls back: the work stays due in its rows, and the sweeper dispatches it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import redis
from django.conf import settings

from outbox import ratelimit

logger = logging.getLogger(__name__)

# How long a key outlives a task that died, or a task lost with its broker message (a
# running task renews it each round; a round slower than this only lets a second one start).
KEY_TTL_MS = 5_000


def key(kind: str, bot_id: int) -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:{kind}:{bot_id}"


def take(name: str, *, countdown: float = 0.0) -> bool | None:
    """SET NX, for a task due in `countdown` seconds: True when set (publish the task), False
    when already there (a task is coming), None when Redis failed."""
    try:
        return bool(ratelimit.redis_client().set(name, b"1", nx=True, px=int(countdown * 1000) + KEY_TTL_MS))
    except redis.RedisError as exc:
        logger.warning("could not set %s: %s", name, exc)
        return None


def wake(name: str, publish: Callable[[], bool], *, countdown: float = 0.0) -> bool | None:
    """Publish the task (after `countdown`) unless one is queued or running. True: a task
    is coming; False: the publish failed (the key is let go, so the next wake-up tries
    again); None: Redis failed, nothing was published, the caller decides the fallback."""
    taken = take(name, countdown=countdown)
    if taken is None:
        return None
    if not taken:
        return True  # the queued or running task will see the work
    if publish():
        return True
    release(name)
    return False


def hand_over(name: str, publish: Callable[[], bool], *, holds_key: bool, countdown: float = 0.0) -> None:
    """A task's continuation: it inherits the key (kept alive until it runs), or, from a
    task that no longer holds it, it is an ordinary wake-up."""
    if not holds_key:
        wake(name, publish, countdown=countdown)
        return
    renew(name, countdown=countdown)
    if not publish():
        release(name)  # the next wake-up, or the sweeper


def renew(name: str, *, countdown: float = 0.0) -> None:
    """Keep the key for a task that runs on (or runs again in `countdown` seconds)."""
    _quietly("pexpire", name, int(countdown * 1000) + KEY_TTL_MS)


def release(name: str) -> None:
    _quietly("delete", name)


def _quietly(command: str, *args: object) -> None:
    with contextlib.suppress(redis.RedisError):  # the key expires by itself
        getattr(ratelimit.redis_client(), command)(*args)
