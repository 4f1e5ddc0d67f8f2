"""A bot's set-up: adding a bot and giving it its webhook secret (manage.py add_bot and
set_webhook, the demo's set-up). The inbox's work lives by concept: bots/inbox.py (storing
updates), bots/routing.py, bots/runs.py (consumer runs), bots/polling.py (getUpdates)."""

from __future__ import annotations

import secrets

from django.conf import settings

from bots.inbox import forget_bot
from bots.models import Bot


def new_webhook_secret() -> str:
    """256 random bits in Telegram's alphabet for secret tokens (A-Z a-z 0-9 _ -)."""
    return secrets.token_urlsafe(32)


def bot_webhook_secret_ensure(bot: Bot) -> str:
    """The bot's webhook secret, generated and saved first for a bot made without one."""
    if not bot.webhook_secret:
        bot.webhook_secret = new_webhook_secret()
        Bot.objects.filter(pk=bot.pk, webhook_secret="").update(webhook_secret=bot.webhook_secret)
        bot.refresh_from_db(fields=["webhook_secret"])
        forget_bot()
    return bot.webhook_secret


def add_bot(
    *,
    name: str,
    token: str,
    webhook_secret: str | None = None,
    api_base_url: str | None = None,
    responder: str | None = None,
    rate_limit: int | None = None,
    ops_chat_id: int | None = None,
) -> tuple[Bot, bool]:
    """Create or update a bot (idempotent). Raises ValidationError on bad input."""
    bot = Bot.objects.filter(name=name).first()
    created = bot is None
    if bot is None:
        bot = Bot(name=name, rate_limit=settings.DOVECOTE_DEFAULT_RATE_LIMIT)
    bot.token = token
    if webhook_secret is not None:
        bot.webhook_secret = webhook_secret
    elif not bot.webhook_secret:
        # Every bot has one: the webhook refuses a bot without it (unless DEBUG is on).
        bot.webhook_secret = new_webhook_secret()
    if api_base_url is not None:
        bot.api_base_url = api_base_url
    if responder is not None:
        bot.responder = responder
    if rate_limit is not None:
        bot.rate_limit = rate_limit
    if ops_chat_id is not None:
        bot.ops_chat_id = ops_chat_id
    bot.full_clean(validate_unique=False)
    bot.save()
    return bot, created
