from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from bots.models import Bot, Responder
from bots.services import add_bot


class Command(BaseCommand):
    help = "Create or update a bot (idempotent) and print its webhook path."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="Bot name; part of the webhook URL (A-Z a-z 0-9 _ -).")
        parser.add_argument("--token", required=True, help="Bot API token from @BotFather.")
        parser.add_argument(
            "--webhook-secret", help="Secret token Telegram sends with each update (1-256 of A-Z a-z 0-9 _ -)."
        )
        parser.add_argument("--api-base-url", help="Bot API root for this bot (a local Bot API server or the sandbox).")
        parser.add_argument("--responder", choices=[r.value for r in Responder], help="Who writes auto-replies.")
        parser.add_argument("--rate-limit", type=int, metavar="MSGS_PER_SEC", help="Messages per second for this bot.")
        parser.add_argument(
            "--ops-chat-id", type=int, metavar="CHAT_ID", help="A chat that gets this bot's own ops digest."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["rate_limit"] is not None and not 1 <= options["rate_limit"] <= 1000:
            raise CommandError("--rate-limit must be between 1 and 1000 messages per second")
        had_secret = Bot.objects.filter(name=options["name"]).exclude(webhook_secret="").exists()
        try:
            bot, created = add_bot(
                name=options["name"],
                token=options["token"],
                webhook_secret=options["webhook_secret"],
                api_base_url=options["api_base_url"],
                responder=options["responder"],
                rate_limit=options["rate_limit"],
                ops_chat_id=options["ops_chat_id"],
            )
        except ValidationError as exc:
            messages = "; ".join(f"{field}: {' '.join(errs)}" for field, errs in exc.message_dict.items())
            raise CommandError(messages) from exc
        self.stdout.write(f"{'Created' if created else 'Updated'} bot {bot.name}. Webhook path: {bot.webhook_path}")
        if options["webhook_secret"] is None and not had_secret:
            # Generated: printed this once (set_webhook hands it to Telegram; nobody else needs it).
            self.stdout.write(f"Webhook secret (generated, shown once): {bot.webhook_secret}")
