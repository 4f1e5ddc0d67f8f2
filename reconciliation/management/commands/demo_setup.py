from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from bots.services import add_bot

DEMO_TOKEN = "123456789:DEMO-dovecote-sandbox-token-0123456789"  # noqa: S105 - the sandbox accepts any token


class Command(BaseCommand):
    help = "Create the demo bot (talking to the local Bot API sandbox) and the admin user admin/admin. Idempotent."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--sandbox", default="http://127.0.0.1:8081", help="Bot API sandbox base URL.")

    def handle(self, *args: Any, **options: Any) -> None:
        bot, _ = add_bot(
            name="demo",
            token=DEMO_TOKEN,
            webhook_secret="demo-webhook-secret",  # noqa: S106 - demo only
            api_base_url=options["sandbox"],
            responder="echo",
            rate_limit=30,
        )
        User = get_user_model()
        admin = User.objects.filter(username="admin").first()
        if admin is None:
            User.objects.create_superuser("admin", "admin@example.com", "admin")
        self.stdout.write(
            f"Demo bot '{bot.name}' -> {options['sandbox']} (webhook {bot.webhook_path}).\n"
            "Admin: http://127.0.0.1:8000/admin/  user: admin  password: admin"
        )
