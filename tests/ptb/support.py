"""Helpers of the python-telegram-bot consumer tests."""

from __future__ import annotations

import itertools
import time
from typing import Any

from django.test import override_settings

from bots.inbox import inbox_update_store
from bots.models import Bot, ConsumerRun, InboundUpdate, RunState
from reconciliation.sweeper import sweep
from tests.support import Process, start_worker

PTB_SETTINGS = "tests.ptb.settings"
LEASE = 2  # seconds: the workers' send and run leases, so that a dead worker is noticed fast
_raw_update_ids = itertools.count(50_000_000)


def ptb_worker(
    process_env: dict[str, str],
    processes: list[Process],
    *,
    failpoint: str = "",
    name: str,
    pool: str = "solo",
    concurrency: int = 1,
    env: dict[str, str] | None = None,
) -> Process:
    """A Celery worker with the example bots' consumers (tests/ptb/consumers.py); `-P solo`
    by default, so that a failpoint's SIGKILL takes the whole worker down."""
    env = {
        **process_env,
        "DJANGO_SETTINGS_MODULE": PTB_SETTINGS,
        "DOVECOTE_SEND_LEASE_SECONDS": str(LEASE),
        "DOVECOTE_CONSUMER_LEASE_SECONDS": str(LEASE),
        "DOVECOTE_TEST_SILENCED_CHECKS": "dovecote.E001",
        **(env or {}),
    }
    if failpoint:
        env["DOVECOTE_FAILPOINTS"] = failpoint
    proc = start_worker(env, pool=pool, concurrency=concurrency, name=name)
    processes.append(proc)
    return proc


def user_presses(sandbox: Any, bot: Bot, chat_id: int, data: str, *, message_id: int) -> InboundUpdate:
    """A user presses an inline button of the bot's message `message_id`."""
    payload = sandbox.push_callback(bot.token, chat_id, data, message_id=message_id)["update"]
    update, _ = inbox_update_store(bot=bot, payload=payload)
    return update


def run_of(update: InboundUpdate, consumer: str) -> ConsumerRun:
    return ConsumerRun.objects.get(update=update, consumer=consumer)


def sweep_once() -> dict[str, int]:
    """The sweeper as beat runs it, without the redispatch grace."""
    with override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0):
        return sweep()


def user_sends_location(bot: Bot, chat_id: int, latitude: float, longitude: float) -> InboundUpdate:
    """A user shares a location (an update the sandbox does not make: written as Telegram's)."""
    user = {"id": chat_id, "is_bot": False, "first_name": f"User {chat_id}"}
    payload = {
        "update_id": next(_raw_update_ids),
        "message": {
            "message_id": next(_raw_update_ids),
            "from": user,
            "chat": {"id": chat_id, "type": "private", "first_name": user["first_name"]},
            "date": int(time.time()),
            "location": {"latitude": latitude, "longitude": longitude},
        },
    }
    update, _ = inbox_update_store(bot=bot, payload=payload)
    return update


def user_writes(sandbox: Any, bot: Bot, chat_id: int, text: str, **kw: Any) -> InboundUpdate:
    """A user writes to the bot: the sandbox makes Telegram's update, the inbox stores it."""
    payload = sandbox.push_message(bot.token, chat_id, text, **kw)["update"]
    update, _ = inbox_update_store(bot=bot, payload=payload)
    return update


def runs_of(consumer: str) -> list[ConsumerRun]:
    return list(ConsumerRun.objects.filter(consumer=consumer).order_by("pk"))


def all_done(consumer: str, n: int) -> bool:
    return ConsumerRun.objects.filter(consumer=consumer, state=RunState.DONE).count() == n
