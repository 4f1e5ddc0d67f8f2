from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox.services import api_client_add


class Command(BaseCommand):
    help = "Create or update a REST API client (a user with a token) allowed to use the given bots; print its token."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The client's name (its username).")
        parser.add_argument(
            "--bot", action="append", required=True, dest="bots", metavar="BOT", help="A bot it may use (repeat)."
        )
        parser.add_argument(
            "--payload-access", action="store_true", help="May read message texts and other personal fields."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            client, token, created = api_client_add(
                name=options["name"], bot_names=options["bots"], payload_access=options["payload_access"]
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        bots = ", ".join(sorted(client.bots.values_list("name", flat=True)))
        self.stdout.write(f"{'Created' if created else 'Updated'} API client {options['name']} for bots: {bots}.")
        self.stdout.write(f"Token: {token}")
        self.stdout.write("Use it as: Authorization: Token <token>")
