"""The rows of python-telegram-bot consumers (bots/ptb): the journal of the Bot API calls a
handling made, and the handlers' persisted data. Imported by bots/models.py, so they belong
to the bots app and its migrations."""

from django.db import models


class CallKind(models.TextChoices):
    OUTBOX = "outbox", "outbox (a message, sent under the outbox's rules)"
    READ = "read", "read (called live, its answer recorded)"
    EFFECT = "effect", "effect (through the effect ledger, at most once)"
    REFUSED = "refused", "refused (not available to a handler)"


class HandlerCall(models.Model):
    """One Bot API call a python-telegram-bot handler made while handling one update: written
    before the call goes out, its answer recorded once known. A re-run of the handling is
    answered from here, so it makes no call twice; a re-run whose call differs (another
    method or target at the same place) is not deterministic and stops."""

    bot = models.ForeignKey("bots.Bot", on_delete=models.CASCADE, related_name="+", db_index=False)
    update = models.ForeignKey(
        "bots.InboundUpdate", on_delete=models.CASCADE, related_name="handler_calls", db_index=False
    )
    consumer = models.CharField(max_length=100)
    ordinal = models.PositiveIntegerField(help_text="The call's place in the handling: 0 for the first call.")
    method = models.CharField(max_length=64, help_text="Bot API method, e.g. sendMessage.")
    target = models.CharField(
        max_length=200, blank=True, help_text="Whom the call concerns (chat, message, callback query, file...)."
    )
    kind = models.CharField(max_length=8, choices=CallKind.choices)
    message = models.ForeignKey(
        "outbox.OutboundMessage",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="The outbox row of a message-like call.",
    )
    ok = models.BooleanField(null=True, blank=True, help_text="Empty while the answer is not known.")
    result = models.JSONField(null=True, blank=True, help_text="Telegram's result, as the handler got it.")
    error = models.JSONField(
        null=True, blank=True, help_text="Telegram's error answer (error_code, description, parameters)."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    answered_at = models.DateTimeField(null=True, blank=True)
    result_purged_at = models.DateTimeField(
        null=True, blank=True, help_text="The result was cut after DOVECOTE_PAYLOAD_RETENTION_DAYS."
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["update", "consumer", "ordinal"], name="handlercall_unique_ordinal"),
        ]
        indexes = [
            # Retention: answers whose result is still kept, oldest first.
            models.Index(
                fields=["answered_at"], name="handlercall_purge_idx", condition=models.Q(result_purged_at__isnull=True)
            ),
        ]

    def __str__(self) -> str:
        return f"call {self.ordinal} of {self.consumer} on update {self.update_id}: {self.method} {self.target}"


class HandlerData(models.Model):
    """What python-telegram-bot's persistence keeps for one consumer: a user's user_data, a
    chat's chat_data, the bot_data, a conversation's state. Loaded for the update's user and
    chat only, written with the run's completion."""

    class Kind(models.TextChoices):
        USER = "user", "user_data"
        CHAT = "chat", "chat_data"
        BOT = "bot", "bot_data"
        CONVERSATION = "conv", "conversation state"

    bot = models.ForeignKey("bots.Bot", on_delete=models.CASCADE, related_name="+", db_index=False)
    consumer = models.CharField(max_length=100)
    kind = models.CharField(max_length=4, choices=Kind.choices)
    key = models.CharField(
        max_length=300, help_text="The user or chat id; for a conversation, its handler's name and key."
    )
    # Text, not jsonb: jsonb reorders an object's keys, and a handler's dict (user_data) keeps
    # the order it was filled in, as python-telegram-bot's own persistences keep it.
    data = models.TextField(help_text="The data as JSON, in the order the handler wrote it.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["bot", "consumer", "kind", "key"], name="handlerdata_unique_key"),
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} {self.key} of {self.consumer}"
