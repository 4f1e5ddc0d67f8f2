"""Receiving: bots, the inbox of updates, and consumer runs."""

import re

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q

# Telegram's rule for secret_token: 1-256 characters of A-Z, a-z, 0-9, _ and -.
WEBHOOK_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
BOT_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def validate_webhook_secret(value: str) -> None:
    if value and not WEBHOOK_SECRET_RE.match(value):
        raise ValidationError("A webhook secret is 1-256 characters of A-Z, a-z, 0-9, _ and - (Telegram's rule).")


def validate_bot_name(value: str) -> None:
    if not BOT_NAME_RE.match(value):
        raise ValidationError("A bot name is 1-64 characters of A-Z, a-z, 0-9, _ and - (it is part of a URL).")


class Responder(models.TextChoices):
    ECHO = "echo", "echo"
    OPENAI = "openai", "OpenAI-compatible model"
    NONE = "none", "none (no auto-reply)"


class Bot(models.Model):
    name = models.CharField(
        max_length=64, unique=True, validators=[validate_bot_name], help_text="Names the webhook URL."
    )
    token = models.CharField(max_length=200, help_text="Bot API token from @BotFather. Never shown after saving.")
    webhook_secret = models.CharField(
        max_length=256,
        blank=True,
        validators=[validate_webhook_secret],
        help_text="Telegram sends it in X-Telegram-Bot-Api-Secret-Token; requests without it get 403.",
    )
    api_base_url = models.URLField(
        blank=True, help_text="Bot API root for this bot; empty means TELEGRAM_API_BASE_URL."
    )
    is_active = models.BooleanField(default=True, help_text="Inactive bots answer 404 at the webhook.")
    responder = models.CharField(
        max_length=16, choices=Responder.choices, default=Responder.ECHO, help_text="Who writes auto-replies."
    )
    rate_limit = models.PositiveIntegerField(
        default=30, help_text="Messages per second for this bot (Telegram: 30; paid broadcasts up to 1,000)."
    )
    openai_model = models.CharField(max_length=100, blank=True, help_text="Overrides DOVECOTE_OPENAI_MODEL.")
    system_prompt = models.TextField(blank=True, help_text="System prompt for the openai responder.")
    polling_offset = models.BigIntegerField(
        default=0, help_text="Next getUpdates offset for poll_updates (development without a public URL)."
    )
    ops_chat_id = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="A Telegram chat that gets the ops digest of this bot alone (its dead letters, cases and "
        "circuit), sent by the DOVECOTE_OPS_BOT bot; empty: only the global ops chat hears of it.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        # Never the token.
        return f"<Bot {self.name}>"

    def clean(self) -> None:
        from outbox.botapi import api_host_allowed

        if self.api_base_url and not api_host_allowed(self.api_base_url):
            raise ValidationError(
                {"api_base_url": "This host is not on DOVECOTE_BOT_API_HOSTS: the bot's token would be sent there."}
            )

    @property
    def webhook_path(self) -> str:
        return f"/webhooks/telegram/{self.name}/"


class UpdateState(models.TextChoices):
    """An update is stored `new` and routed (its consumer runs written) in one transaction
    that makes it `done`: there is no state in between to be stranded in."""

    NEW = "new", "new"
    DONE = "done", "done (routed to consumers)"


class InboundUpdate(models.Model):
    """A Telegram update, stored before the webhook answers 200. Unique per (bot, update_id)."""

    # No index of its own: inbox_unique_update_per_bot (bot, update_id) serves every look by
    # bot, and each index costs every insert and state change (the webhook's hot path).
    bot = models.ForeignKey(Bot, on_delete=models.PROTECT, related_name="updates", db_index=False)
    update_id = models.BigIntegerField()
    update_type = models.CharField(max_length=40, blank=True, help_text="message, callback_query, ...")
    chat_id = models.BigIntegerField(null=True, blank=True)
    chat_type = models.CharField(max_length=20, blank=True)
    user_id = models.BigIntegerField(null=True, blank=True)
    message_id = models.BigIntegerField(null=True, blank=True)
    payload = models.JSONField(help_text="The Update exactly as Telegram sent it.")
    state = models.CharField(max_length=16, choices=UpdateState.choices, default=UpdateState.NEW)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(help_text="When routing is due (again).")
    trace_id = models.CharField(max_length=64)
    last_error = models.TextField(blank=True)
    received_at = models.DateTimeField(auto_now_add=True)
    processed_at = models.DateTimeField(null=True, blank=True)
    payload_purged_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The payload was cut to its update_id after DOVECOTE_PAYLOAD_RETENTION_DAYS; the columns stay.",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["bot", "update_id"], name="inbox_unique_update_per_bot"),
        ]
        indexes = [
            models.Index(fields=["next_attempt_at"], name="inbox_due_idx", condition=Q(state="new")),
            # The router's claim: a bot's new updates, oldest first, read a batch at a time
            # (without it each batch sorted the bot's whole backlog).
            models.Index(fields=["bot", "id"], name="inbox_new_idx", condition=Q(state="new")),
            models.Index(fields=["bot", "chat_id", "-received_at"], name="inbox_chat_idx"),
            # The admin's search by chat id, any bot.
            models.Index(fields=["chat_id", "id"], name="inbox_chat_search_idx"),
            # Payload retention: updates whose text is still kept, oldest first.
            models.Index(fields=["received_at"], name="inbox_purge_idx", condition=Q(payload_purged_at__isnull=True)),
            # Looked up by `=` only: an Index, not db_index, which on PostgreSQL adds a
            # varchar_pattern_ops twin for LIKE that every write would pay for.
            models.Index(fields=["trace_id"], name="inbox_trace_idx"),
        ]

    def __str__(self) -> str:
        return f"update {self.update_id} of {self.bot_id} [{self.state}]"

    @property
    def text(self) -> str:
        """The message's text or caption; empty for updates without one."""
        message = self.payload.get(self.update_type) if self.update_type else None
        if not isinstance(message, dict):
            return ""
        text = message.get("text") or message.get("caption") or ""
        return text if isinstance(text, str) else ""


class RunState(models.TextChoices):
    PENDING = "pending", "pending"
    RUNNING = "running", "running"
    RETRY = "retry", "retry"
    DONE = "done", "done"
    FAILED = "failed", "failed (dead letter)"
    CANCELLED = "cancelled", "cancelled"


class ConsumerRun(models.Model):
    """One consumer's processing of one update, retried independently of the others."""

    # Looked up through run_unique_consumer_per_update (update, consumer): no index of its own.
    update = models.ForeignKey(InboundUpdate, on_delete=models.CASCADE, related_name="runs", db_index=False)
    bot = models.ForeignKey(Bot, on_delete=models.PROTECT, related_name="consumer_runs")
    consumer = models.CharField(max_length=100)
    state = models.CharField(max_length=16, choices=RunState.choices, default=RunState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=5)
    next_attempt_at = models.DateTimeField()
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    last_error_class = models.CharField(max_length=16, blank=True)
    cancel_reason = models.TextField(blank=True)
    outcome = models.CharField(
        max_length=64,
        blank=True,
        help_text="What the consumer reported when it finished, e.g. answered, or coalesced into a later reply.",
    )
    trace_id = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["update", "consumer"], name="run_unique_consumer_per_update"),
        ]
        indexes = [
            models.Index(fields=["next_attempt_at"], name="run_due_idx", condition=Q(state__in=["pending", "retry"])),
            models.Index(fields=["lease_expires_at"], name="run_lease_idx", condition=Q(state="running")),
            # Retention: does this update still have a run to do? (only live runs indexed)
            models.Index(
                fields=["update"], name="run_unfinished_idx", condition=Q(state__in=["pending", "running", "retry"])
            ),
            models.Index(fields=["trace_id"], name="run_trace_idx"),  # `=` only, as inbox_trace_idx
        ]

    def __str__(self) -> str:
        return f"{self.consumer} on update {self.update_id} [{self.state}]"


class ChatState(models.Model):
    """Per (bot, chat) reply guard: the newest message already answered. Moved forward only
    by a conditional UPDATE, so two workers can never both answer the same messages."""

    # chatstate_unique_chat_per_bot (bot, chat) serves a look by bot.
    bot = models.ForeignKey(Bot, on_delete=models.CASCADE, related_name="chat_states", db_index=False)
    chat_id = models.BigIntegerField()
    last_answered_message_id = models.BigIntegerField(
        null=True, blank=True, help_text="Messages up to this id have been answered; they never get a second answer."
    )
    last_answered_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["bot", "chat_id"], name="chatstate_unique_chat_per_bot"),
        ]
        # Retention: chats quiet the longest, first.
        indexes = [models.Index(fields=["updated_at"], name="chatstate_updated_idx")]

    def __str__(self) -> str:
        return f"chat {self.chat_id} of {self.bot_id}: answered up to {self.last_answered_message_id}"


class AnalyticsEvent(models.Model):
    """One row per update, written by the `analytics` consumer (for the dashboard)."""

    # analytics_bot_received_idx (bot, received_at) serves a look by bot.
    bot = models.ForeignKey(Bot, on_delete=models.CASCADE, related_name="analytics_events", db_index=False)
    update = models.OneToOneField(
        InboundUpdate, on_delete=models.CASCADE, related_name="analytics_event", help_text="The update it describes."
    )
    update_type = models.CharField(max_length=40, blank=True, help_text="message, callback_query, ...")
    chat_id = models.BigIntegerField(null=True, blank=True)
    chat_type = models.CharField(max_length=20, blank=True)
    user_id = models.BigIntegerField(null=True, blank=True)
    message_date = models.DateTimeField(
        null=True, blank=True, help_text="When Telegram says the message was sent (whole seconds)."
    )
    received_at = models.DateTimeField(help_text="When the webhook (or poller) stored the update.")
    latency_ms = models.IntegerField(
        null=True, blank=True, help_text="From Telegram's message date to receipt, in milliseconds."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["bot", "received_at"], name="analytics_bot_received_idx")]

    def __str__(self) -> str:
        return f"{self.update_type} in {self.chat_id} ({self.latency_ms} ms)"


# The rows of python-telegram-bot consumers (bots/ptb), part of this app.
from bots.ptb.models import HandlerCall, HandlerData  # noqa: E402, F401
