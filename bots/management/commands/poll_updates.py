"""Long polling for development without a public URL: getUpdates into the inbox."""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from bots.models import Bot
from bots.polling import PollingConflict, inbox_poll_fetch, inbox_poll_store
from outbox import botapi


class _Stop(Exception):
    pass


class Command(BaseCommand):
    help = (
        "Fetch updates with getUpdates (long polling) into the same inbox as the webhook; "
        "resumes from the stored offset. Ctrl-C stops it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--timeout", type=int, default=25, help="Long-poll seconds per request (0-50).")
        parser.add_argument("--once", action="store_true", help="One getUpdates round, then exit (for tests).")
        parser.add_argument(
            "--delete-webhook",
            action="store_true",
            help="Call deleteWebhook first (polling and a webhook exclude each other).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        bot = Bot.objects.filter(name=options["name"]).first()
        if bot is None:
            raise CommandError(f"no bot named {options['name']!r}; create it with add_bot")
        timeout = max(0, min(50, options["timeout"]))
        if options["delete_webhook"]:
            outcome = botapi.call(token=bot.token, base_url=bot.api_base_url, method="deleteWebhook", params={})
            if not outcome.ok:
                raise CommandError(f"deleteWebhook failed ({outcome.error_class}): {outcome.description}")

        stopping = False
        waiting = False

        def on_signal(signum: int, frame: FrameType | None) -> None:
            nonlocal stopping
            stopping = True
            if waiting:
                # Interrupt the long poll; nothing of it is stored, and the unconfirmed
                # offset makes Telegram hand those updates out again next time.
                raise _Stop

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.stdout.write(f"Polling {bot.name} from offset {bot.polling_offset} (Ctrl-C stops)")
        self.stdout.flush()
        failures = 0
        try:
            while not stopping:
                try:
                    waiting = True
                    try:
                        batch = inbox_poll_fetch(bot=bot, timeout=timeout)
                    finally:
                        waiting = False
                    # Not interruptible: the batch and the offset commit together.
                    stored = inbox_poll_store(bot=bot, batch=batch)
                except _Stop:
                    break
                except PollingConflict as exc:
                    raise CommandError(
                        f"getUpdates refused (409 Conflict): {exc}. This bot has a webhook set; polling and a "
                        f"webhook exclude each other. Delete it with `manage.py poll_updates {bot.name} "
                        "--delete-webhook` (or deleteWebhook in the Bot API) and try again."
                    ) from exc
                except Exception as exc:  # a network hiccup must not end a dev session
                    if options["once"]:
                        raise CommandError(f"getUpdates failed: {type(exc).__name__}: {exc}") from exc
                    failures += 1
                    pause = min(30.0, 2.0**failures)
                    self.stderr.write(f"getUpdates failed ({type(exc).__name__}: {exc}); retrying in {pause:.0f}s")
                    time.sleep(pause)
                    continue
                failures = 0
                if stored:
                    self.stdout.write(f"Stored {stored} update(s); next offset {bot.polling_offset}")
                    self.stdout.flush()
                if options["once"]:
                    break
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.stdout.write(f"Stopped; next offset {bot.polling_offset}")
