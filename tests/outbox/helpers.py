"""Driving the send service in-process, as one worker would, against the sandbox over HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from typing import Any

from django.test import override_settings
from django.utils import timezone

from outbox import ratelimit, services
from outbox.models import OutboundMessage, State
from outbox.sending import rules, single

_keys = count(1)

STOP = {"circuit-open", "circuit-opened", "waiting-for-earlier", "not-waiting"}


def enqueue(bot: Any, *, chat_id: int = 42, text: str = "hello", key: str | None = None, **kw: Any) -> OutboundMessage:
    message, _ = services.outbound_message_enqueue(
        bot_id=bot.pk,
        chat_id=chat_id,
        payload={"text": text},
        idempotency_key=f"k{next(_keys)}" if key is None else key,
        **kw,
    )
    return message


def drive(message_id: int, *, timeout: float = 15.0) -> tuple[rules.SendResult, OutboundMessage]:
    """Call the send service until the message leaves the queue or cannot move now,
    sleeping exactly the countdowns the service asks for (as the Celery task would)."""
    deadline = time.monotonic() + timeout
    reserved = False
    while True:
        result = single.outbound_message_send(message_id, slot_reserved=reserved)
        message = OutboundMessage.objects.get(pk=message_id)
        if message.state not in (State.PENDING, State.RETRY) or result.status in STOP:
            return result, message
        if time.monotonic() > deadline:
            raise AssertionError(f"message {message_id} still {message.state} after {timeout}s: {result}")
        wait = result.countdown
        if wait is None:
            wait = max(0.0, (message.next_attempt_at - timezone.now()).total_seconds())
        time.sleep(max(0.0, wait))
        reserved = result.slot_reserved


def api_client(name: str, *bots: Any, payload_access: bool = True) -> Any:
    """A REST API client as `manage.py add_api_client NAME --bot ...` makes it, logged in."""
    from rest_framework.test import APIClient

    client_row, token, _ = services.api_client_add(
        name=name, bot_names=[b.name for b in bots], payload_access=payload_access
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    client.user = client_row.user
    return client


@contextmanager
def limiter_redis_at(url: str) -> Iterator[None]:
    """Point this process's rate limiter and outbox keys at another Redis (its clients are
    cached per process), and back at the real one afterwards."""
    caches = (
        ratelimit._storage,
        ratelimit._limiter,
        ratelimit.redis_client,
        ratelimit._reserve_script,
        ratelimit._reserve_many_script,
    )
    try:
        with override_settings(REDIS_URL=url):
            for cached in caches:
                cached.cache_clear()
            yield
    finally:
        for cached in caches:
            cached.cache_clear()
