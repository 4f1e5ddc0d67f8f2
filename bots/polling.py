"""getUpdates polling (manage.py poll_updates), for a bot without a webhook: each batch
stored through the webhook's path and the bot's offset moved past it together."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import transaction

from bots import registry
from bots.inbox import as_int64, inbox_update_store, new_trace_id
from bots.models import Bot
from core.logs import current_trace_id

logger = logging.getLogger(__name__)


class PollingConflict(Exception):
    """getUpdates refused with 409: a webhook is set (or another poller is running)."""


def inbox_poll_fetch(*, bot: Bot, timeout: float = 0, limit: int = 100) -> list[dict[str, Any]]:
    """One long-polling getUpdates request from the bot's stored offset (which confirms
    every update below it to Telegram). Raises PollingConflict on 409."""
    from telegram import error as tg_error

    from outbox import botapi

    params: dict[str, Any] = {"offset": bot.polling_offset, "timeout": int(timeout), "limit": limit}
    allowed = registry.wanted_update_types()
    if allowed:
        params["allowed_updates"] = allowed
    read_timeout = timeout + settings.DOVECOTE_TELEGRAM_READ_TIMEOUT

    async def _get_updates() -> Any:
        client = await botapi.get_bot(bot.token, bot.api_base_url)
        return await client.do_api_request("getUpdates", api_kwargs=params, read_timeout=read_timeout)

    try:
        batch = botapi.run_sync(_get_updates(), timeout=read_timeout + 10)
    except tg_error.Conflict as exc:
        raise PollingConflict(str(exc)) from exc
    return [p for p in batch or [] if isinstance(p, dict) and as_int64(p.get("update_id")) is not None]


def inbox_poll_store(*, bot: Bot, batch: list[dict[str, Any]]) -> int:
    """Store a getUpdates batch through the webhook's path (same dedupe) and move the bot's
    offset past it, in one transaction: a crash re-fetches at most this batch, and the
    inbox's unique (bot, update_id) drops it again. Returns how many updates were new."""
    if not batch:
        return 0
    created_count = 0
    with transaction.atomic():
        for payload in batch:
            trace_id = new_trace_id()
            current_trace_id.set(trace_id)
            update, created = inbox_update_store(bot=bot, payload=payload, trace_id=trace_id)
            created_count += created
            logger.info(
                "update %s %s (polling)",
                update.update_id,
                "stored" if created else "duplicate dropped",
                extra={"bot": bot.name, "update_type": update.update_type},
            )
        next_offset = max(p["update_id"] for p in batch) + 1
        Bot.objects.filter(pk=bot.pk, polling_offset__lt=next_offset).update(polling_offset=next_offset)
    current_trace_id.set("")
    bot.polling_offset = max(bot.polling_offset, next_offset)
    return created_count
