"""``manage.py telegram_sandbox``: run the Telegram Bot API sandbox in the foreground."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

# Deliberately model-free: the sandbox must start even before the project is migrated.
from bots.sandbox.cli import add_arguments, serve_until_signalled, server_from_options


class Command(BaseCommand):
    help = "Run the local Telegram Bot API sandbox (records calls, injects faults)."
    requires_system_checks: list[str] = []  # starts instantly, without touching the database
    requires_migrations_checks = False

    def add_arguments(self, parser: CommandParser) -> None:
        add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        def announce(line: str) -> None:
            self.stdout.write(line)
            self.stdout.flush()  # supervisors and tests wait for this exact line

        serve_until_signalled(server_from_options(options), announce)
        self.stdout.write("Bot API sandbox stopped")
        self.stdout.flush()
