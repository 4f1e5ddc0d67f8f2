from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from bots import registry
from bots.models import Bot
from bots.services import bot_webhook_secret_ensure
from outbox import botapi


class Command(BaseCommand):
    help = "Point Telegram at this bot's webhook (setWebhook with the secret token and allowed updates)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--url", required=True, help="Public base URL, e.g. https://bot.example.com")
        parser.add_argument("--drop-pending", action="store_true", help="Drop updates Telegram is holding.")

    def handle(self, *args: Any, **options: Any) -> None:
        bot = Bot.objects.filter(name=options["name"]).first()
        if bot is None:
            raise CommandError(f"no bot named {options['name']!r}; create it with add_bot")
        base = options["url"].rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise CommandError("--url must start with https:// (Telegram requires HTTPS for real bots)")
        url = base + bot.webhook_path
        params: dict[str, Any] = {
            "url": url,
            "drop_pending_updates": options["drop_pending"],
            # Always: a bot made before secrets were generated gets one now, and Telegram with it.
            "secret_token": bot_webhook_secret_ensure(bot),
        }
        allowed = registry.wanted_update_types()
        if allowed:
            params["allowed_updates"] = allowed
        outcome = botapi.call(token=bot.token, base_url=bot.api_base_url, method="setWebhook", params=params)
        if not outcome.ok:
            raise CommandError(f"setWebhook failed ({outcome.error_class}): {outcome.description}")
        self.stdout.write(f"Webhook set: {url} (allowed updates: {', '.join(allowed) or 'all'})")
