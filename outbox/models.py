"""Delivery primitives: outbound messages, their attempts, dead letters, the effect ledger
and circuit state.

Rows change state only through outbox/transitions.py (conditional UPDATEs); the admin shows
states read-only.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q


class State(models.TextChoices):
    PENDING = "pending", "pending"
    SENDING = "sending", "sending"
    SENT = "sent", "sent"
    RETRY = "retry", "retry"
    FAILED = "failed", "failed (dead letter)"
    CANCELLED = "cancelled", "cancelled"
    UNKNOWN = "unknown", "unknown (ambiguous)"


# Waiting to be sent: due now or later.
WAITING_STATES = (State.PENDING, State.RETRY)


class ErrorClass(models.TextChoices):
    RATE_LIMITED = "rate_limited", "rate limited (429)"
    TRANSIENT = "transient", "transient"
    AMBIGUOUS = "ambiguous", "ambiguous (maybe delivered)"
    PERMANENT = "permanent", "permanent"
    AUTH = "auth", "auth"
    MIGRATED = "migrated", "chat migrated"
    EXPIRED = "expired", "expired"
    EXHAUSTED = "exhausted", "retry budget exhausted"


class OnAmbiguous(models.TextChoices):
    HOLD = "hold", "hold for an operator"
    RESEND = "resend", "resend (a duplicate is possible)"


class OutboundMessage(models.Model):
    """One outgoing Bot API call. It exists as a row before it exists as a request."""

    # No index of its own: outbox_unique_key_per_bot (bot, key) serves every look by bot.
    bot = models.ForeignKey("bots.Bot", on_delete=models.PROTECT, related_name="outbound_messages", db_index=False)
    chat_id = models.BigIntegerField(help_text="Telegram chat the call goes to.")
    user_id = models.BigIntegerField(null=True, blank=True, help_text="The person it concerns, if any.")
    method = models.CharField(max_length=64, default="sendMessage", help_text="Bot API method, e.g. sendMessage.")
    payload = models.JSONField(
        default=dict, blank=True, help_text="The method's parameters other than chat_id (text, parse_mode, ...)."
    )
    idempotency_key = models.CharField(
        max_length=255,
        help_text="Stable key of this send, unique per bot. A retry reuses it; a new intent gets a new one.",
    )
    request_fingerprint = models.CharField(
        max_length=64,
        blank=True,
        default="",
        editable=False,
        help_text="sha256 of the call as first enqueued (method, chat, payload): the same key with another "
        "call is a conflict, not a replay. Empty on rows older than the check.",
    )
    trace_id = models.CharField(max_length=64, blank=True, help_text="Follows one update end to end.")
    source_update = models.ForeignKey(
        "bots.InboundUpdate",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="outbound_messages",
        help_text="The update this message answers, if any.",
    )
    consumer = models.CharField(max_length=100, blank=True, help_text="Consumer that wrote this message, if any.")
    broadcast = models.CharField(
        max_length=255, blank=True, help_text="Key of the broadcast this message is part of, if any (bulk queue)."
    )
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    ordered = models.BooleanField(default=True, help_text="Wait for earlier messages to the same chat before sending.")
    attempts = models.PositiveIntegerField(default=0, help_text="Requests started so far.")
    max_attempts = models.PositiveIntegerField(default=8, help_text="Retry budget for transient errors.")
    rate_limited_count = models.PositiveIntegerField(default=0, help_text="429 answers received.")
    next_attempt_at = models.DateTimeField(help_text="When the message is due (first send or next retry).")
    lease_owner = models.CharField(max_length=200, blank=True, help_text="Worker holding the send.")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    send_at = models.DateTimeField(null=True, blank=True, help_text="Do not send before this time.")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Cancel instead of sending after this time.")
    on_ambiguous = models.CharField(
        max_length=8,
        choices=OnAmbiguous.choices,
        default=OnAmbiguous.HOLD,
        help_text="What to do when nobody knows whether Telegram got the request.",
    )
    last_error = models.TextField(blank=True)
    last_error_class = models.CharField(max_length=16, choices=ErrorClass.choices, blank=True)
    cancel_reason = models.TextField(blank=True)
    telegram_message_id = models.BigIntegerField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True, help_text="Telegram's result, when it is not a message.")
    payload_purged_at = models.DateTimeField(
        null=True, blank=True, help_text="Text and markup removed after the retention period."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["bot", "idempotency_key"], name="outbox_unique_key_per_bot"),
            models.CheckConstraint(
                condition=~Q(state="sent") | Q(sent_at__isnull=False), name="outbox_sent_has_sent_at"
            ),
            models.CheckConstraint(
                condition=~Q(state="sending") | Q(lease_expires_at__isnull=False),
                name="outbox_sending_has_lease",
            ),
        ]
        indexes = [
            # The queue: only waiting rows are indexed, so the due query stays cheap with
            # millions of sent rows.
            models.Index(
                fields=["next_attempt_at"], name="outbox_due_idx", condition=Q(state__in=["pending", "retry"])
            ),
            # Each lane's queue of a bot, by when each message falls due: the replies' (the
            # drain's claim, which would otherwise walk past every due broadcast message of
            # every bot in outbox_due_idx) and the broadcasts' (the broadcast drain's claim,
            # the sweeper's look for a lost one).
            models.Index(
                fields=["bot", "next_attempt_at"],
                name="outbox_reply_due_idx",
                condition=Q(state__in=["pending", "retry"], broadcast=""),
            ),
            models.Index(
                fields=["bot", "next_attempt_at"],
                name="outbox_bulk_due_idx",
                condition=Q(state__in=["pending", "retry"]) & ~Q(broadcast=""),
            ),
            models.Index(fields=["lease_expires_at"], name="outbox_lease_idx", condition=Q(state="sending")),
            # Per-chat order: earlier messages still open for the same chat.
            models.Index(
                fields=["bot", "chat_id", "id"],
                name="outbox_open_chat_idx",
                condition=Q(state__in=["pending", "retry", "sending"]),
            ),
            models.Index(fields=["state", "updated_at"], name="outbox_state_updated_idx"),
            # Looked up by `=` only (no varchar_pattern_ops twin, as bots' inbox_trace_idx).
            models.Index(fields=["trace_id"], name="outbox_trace_idx"),
            # The admin's search by chat id (every state, newest first).
            models.Index(fields=["chat_id", "id"], name="outbox_chat_search_idx"),
            # Payload retention: sent messages whose text is still kept, oldest first.
            models.Index(
                fields=["sent_at"],
                name="outbox_purge_idx",
                condition=Q(state="sent", payload_purged_at__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.method} to {self.chat_id} [{self.state}]"


# Attempt.outcome of a request Telegram answered with success (else the error class).
ATTEMPT_OK = "ok"


class Attempt(models.Model):
    """One request to the Bot API, written before the request goes out."""

    # attempt_unique_number (message, number) serves a look by message.
    message = models.ForeignKey(OutboundMessage, on_delete=models.CASCADE, related_name="attempt_set", db_index=False)
    number = models.PositiveIntegerField()
    worker = models.CharField(max_length=200, blank=True)
    started_at = models.DateTimeField(help_text="Written before the request was sent.")
    finished_at = models.DateTimeField(
        null=True, blank=True, help_text="Empty: the worker died or lost the answer; the outcome is unknown."
    )
    outcome = models.CharField(max_length=16, blank=True, help_text="ok, or the error class.")
    http_status = models.PositiveIntegerField(null=True, blank=True)
    error_code = models.IntegerField(null=True, blank=True, help_text="Telegram's error_code.")
    description = models.TextField(blank=True, help_text="Telegram's description or the network error.")
    retry_after = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["message_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["message", "number"], name="attempt_unique_number"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of message {self.message_id}: {self.outcome or 'open'}"


class DeadLetterStatus(models.TextChoices):
    OPEN = "open", "open"
    RESOLVED = "resolved", "resolved"
    DISCARDED = "discarded", "discarded"
    REQUEUED = "requeued", "requeued"


class DeadLetter(models.Model):
    """Work that stopped for good: an outbound message or a consumer run. Operators triage it."""

    bot = models.ForeignKey("bots.Bot", on_delete=models.PROTECT, related_name="dead_letters")
    message = models.ForeignKey(
        OutboundMessage, null=True, blank=True, on_delete=models.CASCADE, related_name="dead_letters"
    )
    consumer_run = models.ForeignKey(
        "bots.ConsumerRun", null=True, blank=True, on_delete=models.CASCADE, related_name="dead_letters"
    )
    consumer = models.CharField(max_length=100, blank=True, help_text="Consumer name, for consumer runs.")
    reason_class = models.CharField(max_length=16, choices=ErrorClass.choices)
    first_error = models.TextField(blank=True)
    last_error = models.TextField(blank=True)
    trace_id = models.CharField(max_length=64, blank=True, db_index=True)
    chat_id = models.BigIntegerField(null=True, blank=True)
    idempotency_key = models.CharField(max_length=255, blank=True, db_index=True)
    status = models.CharField(max_length=16, choices=DeadLetterStatus.choices, default=DeadLetterStatus.OPEN)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    resolution_note = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(message__isnull=False) | Q(consumer_run__isnull=False),
                name="deadletter_has_subject",
            ),
        ]
        indexes = [
            models.Index(fields=["status", "reason_class", "-created_at"], name="deadletter_triage_idx"),
            # The admin's list (newest first, any status) and the ops digest's "since".
            models.Index(fields=["created_at", "id"], name="deadletter_created_idx"),
        ]

    def __str__(self) -> str:
        subject = f"message {self.message_id}" if self.message_id else f"run {self.consumer_run_id}"
        return f"dead letter {self.pk}: {subject} ({self.reason_class})"


class EffectState(models.TextChoices):
    STARTED = "started", "started"
    DONE = "done", "done"
    UNKNOWN = "unknown", "unknown"
    FAILED = "failed", "failed (not applied)"


class Effect(models.Model):
    """The effect ledger: one row per side effect, keyed by a key stable across retries."""

    key = models.CharField(max_length=255, unique=True, help_text="Derived from the source and the operation.")
    state = models.CharField(max_length=16, choices=EffectState.choices, default=EffectState.STARTED)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    external_id = models.CharField(max_length=255, blank=True, help_text="Id the other system gave the effect.")
    result = models.JSONField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    trace_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    done_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["created_at"], name="effect_created_idx")]

    def __str__(self) -> str:
        return f"{self.key} [{self.state}]"


class CircuitState(models.TextChoices):
    CLOSED = "closed", "closed"
    OPEN = "open", "open"
    HALF_OPEN = "half_open", "half-open (probing)"


class Circuit(models.Model):
    """A breaker for one destination: a bot's Bot API access or a consumer's endpoint."""

    scope = models.CharField(max_length=200, unique=True, help_text="bot:<id> or consumer:<name>.")
    state = models.CharField(max_length=16, choices=CircuitState.choices, default=CircuitState.CLOSED)
    reason = models.TextField(blank=True)
    consecutive_failures = models.PositiveIntegerField(default=0)
    opened_at = models.DateTimeField(null=True, blank=True)
    next_probe_at = models.DateTimeField(null=True, blank=True)
    manual = models.BooleanField(default=False, help_text="Paused by an operator; only an operator resumes.")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.scope} [{self.state}]"


class IdempotencyRecord(models.Model):
    """The first answer to an API request with an Idempotency-Key, replayed to its retries.

    Kept at least DOVECOTE_IDEMPOTENCY_KEEP_HOURS (24 h by default); `idempotency_records_prune`
    deletes older ones. The outbox row's own key still deduplicates after that.
    """

    scope = models.CharField(max_length=200, help_text="Who and what the key belongs to: user and endpoint.")
    key = models.CharField(max_length=255, help_text="The client's Idempotency-Key header.")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    fingerprint = models.CharField(max_length=64, help_text="sha256 of the request body: a different body is a 422.")
    in_progress = models.BooleanField(default=True, help_text="The first request is still being processed (409).")
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True, help_text="The first answer, replayed as it was.")
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="idempotency_unique_key_per_scope"),
        ]
        indexes = [models.Index(fields=["created_at"], name="idempotency_created_idx")]

    def __str__(self) -> str:
        return f"{self.scope} {self.key} [{'in progress' if self.in_progress else self.response_status}]"


class ApiClient(models.Model):
    """A REST API client: a user with a token (`manage.py add_api_client`), allowed to send
    through some bots and to see their messages. Text and other personal payload fields are
    masked for it unless it has payload access."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_client")
    bots = models.ManyToManyField(
        "bots.Bot",
        blank=True,
        related_name="api_clients",
        help_text="The bots this client may send through; it sees only their messages (others are 404).",
    )
    payload_access = models.BooleanField(
        default=False, help_text="May read message payloads (texts, captions, contacts) in the API's answers."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"API client {self.user}"
