"""Helpers of the python-telegram-bot consumer tests."""

from __future__ import annotations

from typing import Any

from bots.models import Bot, ConsumerRun, InboundUpdate, RunState
from bots.services import inbox_update_store

PTB_SETTINGS = "tests.ptb.settings"


def user_writes(sandbox: Any, bot: Bot, chat_id: int, text: str, **kw: Any) -> InboundUpdate:
    """A user writes to the bot: the sandbox makes Telegram's update, the inbox stores it."""
    payload = sandbox.push_message(bot.token, chat_id, text, **kw)["update"]
    update, _ = inbox_update_store(bot=bot, payload=payload)
    return update


def runs_of(consumer: str) -> list[ConsumerRun]:
    return list(ConsumerRun.objects.filter(consumer=consumer).order_by("pk"))


def all_done(consumer: str, n: int) -> bool:
    return ConsumerRun.objects.filter(consumer=consumer, state=RunState.DONE).count() == n
