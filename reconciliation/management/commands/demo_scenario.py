"""Drive the demo: normal replies, a duplicate webhook, a 429 storm and a failing consumer,
through the real web, worker and sandbox processes, and print what happened."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db.models import Max

from bots.models import Bot, ConsumerRun, InboundUpdate
from bots.sandbox.client import SandboxClient
from outbox.models import OutboundMessage, State


class Command(BaseCommand):
    help = "Run the demo scenario against running web + worker + sandbox processes, then wait for Ctrl-C."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--web", default="http://127.0.0.1:8000")
        parser.add_argument("--sandbox", default="http://127.0.0.1:8081")
        parser.add_argument("--bot", default="demo")
        parser.add_argument("--exit", action="store_true", help="Exit when done instead of waiting for Ctrl-C.")

    def say(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def wait_for(self, url: str, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=1).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise CommandError(f"{what} did not come up at {url}")

    def settle(self, bot: Bot, *, timeout: float = 30) -> None:
        """Wait until the outbox has nothing waiting or sending."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = OutboundMessage.objects.filter(
                bot=bot, state__in=[State.PENDING, State.RETRY, State.SENDING]
            ).count()
            if not busy:
                return
            time.sleep(0.3)

    def handle(self, *args: Any, **options: Any) -> None:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        bot = Bot.objects.get(name=options["bot"])
        sandbox = SandboxClient(options["sandbox"])
        self.wait_for(f"{options['web']}/healthz", "web")
        self.wait_for(f"{options['sandbox']}/sandbox/health", "sandbox")
        # A fresh story each run (this also forgets the webhook). The bot's update and message
        # ids continue after those a previous run stored, as Telegram's would: reissued, they
        # would be dropped as duplicates and taken for messages already answered.
        stored = InboundUpdate.objects.filter(bot=bot)
        last = stored.aggregate(last=Max("update_id"))["last"]
        chats = stored.exclude(chat_id=None).values("chat_id").annotate(last=Max("message_id"))
        message_ids = {str(c["chat_id"]): c["last"] for c in chats if c["last"] is not None}
        sandbox.reset(continue_after={bot.token: {"update_id": last, "message_ids": message_ids}} if last else None)
        call_command("set_webhook", bot.name, "--url", options["web"])
        token = bot.token
        line = "-" * 72

        self.say(f"\n{line}\n1. Normal replies: Alice writes a burst of three messages, Bob one.")
        for text in ("Hi", "Is the bike still available?", "Do you deliver?"):
            sandbox.push_message(token, chat_id=1001, text=text, first_name="Alice")
        sandbox.push_message(token, chat_id=1002, text="Hello from Bob", first_name="Bob")
        time.sleep(1)
        self.settle(bot)
        time.sleep(4)  # the reply debounce gathers Alice's burst
        self.settle(bot)
        for chat, who in ((1001, "Alice"), (1002, "Bob")):
            for text in sandbox.sent_texts(token=token, chat_id=chat):
                self.say(f"   bot -> {who}: {text!r}")

        self.say(f"\n{line}\n2. Duplicate webhook: Telegram delivers Carol's update twice.")
        first = sandbox.push_message(token, chat_id=1003, text="Only once, please", first_name="Carol")
        again = sandbox.push_update(token, first["update"])
        self.say(f"   webhook answered {first['webhook_status']} and {again['webhook_status']}")
        time.sleep(4)
        self.settle(bot)
        self.say(f"   replies Carol received: {len(sandbox.sent_texts(token=token, chat_id=1003))}")

        self.say(f"\n{line}\n3. A 429 storm: Telegram answers 'retry after 2' to the next 4 sends.")
        sandbox.fault("429", token=token, count=4, retry_after=2)
        for i in range(5):
            sandbox.push_message(token, chat_id=2000 + i, text=f"storm {i}", first_name="Dave")
        time.sleep(4)
        self.settle(bot, timeout=40)
        calls = sandbox.calls(token=token, method="sendMessage")
        storm = [c for c in calls if c.get("chat_id") and 2000 <= c["chat_id"] < 2005]
        self.say(
            f"   requests: {len(storm)}, answered 429: {sum(1 for c in storm if c['status'] == 429)}, "
            f"delivered: {sum(1 for c in storm if c['delivered'])} (one per chat, none twice)"
        )

        self.say(f"\n{line}\n4. A failing consumer: the CRM endpoint is down; auto-reply is not held up.")
        sandbox.push_message(token, chat_id=1004, text="Please call me back", first_name="Erin")
        time.sleep(4)
        self.settle(bot)
        self.say(f"   replies Erin received: {sandbox.sent_texts(token=token, chat_id=1004)}")
        for run in ConsumerRun.objects.filter(update__chat_id=1004).order_by("consumer"):
            self.say(
                f"   consumer {run.consumer:12} {run.state:9} attempts={run.attempts} "
                f"{('last error: ' + run.last_error[:60]) if run.last_error else ''}"
            )

        self.say(f"\n{line}\nQueue status")
        call_command("queue_status")
        self.say(
            f"{line}\nAdmin: {options['web']}/admin/ (admin / admin). The sandbox keeps running: "
            f"try more with\n  curl -s -XPOST {options['sandbox']}/sandbox/updates -H 'Content-Type: application/json' "
            f'-d \'{{"token": "{token}", "chat_id": 42, "text": "hi"}}\'\nCtrl-C stops everything.'
        )
        if options["exit"]:
            return
        stop.wait()
