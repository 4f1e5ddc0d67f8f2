"""Recovery and operators' decisions: ambiguous-outcome cases and the audit log."""

from django.conf import settings
from django.db import models


class CaseStatus(models.TextChoices):
    OPEN = "open", "open"
    RESOLVED = "resolved", "resolved"


class Decision(models.TextChoices):
    MARK_DELIVERED = "mark_delivered", "mark delivered"
    RESEND = "resend", "resend with the same key"
    CANCEL = "cancel", "cancel"
    AUTO_RESEND = "auto_resend", "resent by policy (duplicate possible)"


class ReconciliationCase(models.Model):
    """An outcome nobody can know: the request may have reached Telegram, no answer was kept."""

    message = models.ForeignKey(
        "outbox.OutboundMessage", null=True, blank=True, on_delete=models.CASCADE, related_name="cases"
    )
    effect = models.ForeignKey("outbox.Effect", null=True, blank=True, on_delete=models.CASCADE, related_name="cases")
    idempotency_key = models.CharField(max_length=255, db_index=True)
    known_facts = models.JSONField(default=dict, blank=True, help_text="What is known: attempts, errors, times.")
    policy = models.CharField(max_length=8, default="hold")
    status = models.CharField(max_length=16, choices=CaseStatus.choices, default=CaseStatus.OPEN)
    decision = models.CharField(max_length=16, choices=Decision.choices, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decision_reason = models.TextField(blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        # The ops digest counts cases opened since its last run.
        indexes = [models.Index(fields=["created_at"], name="case_created_idx")]

    def __str__(self) -> str:
        return f"case {self.pk} ({self.idempotency_key}) [{self.status}]"


class AuditEntry(models.Model):
    """Who did what, when, why, and what came of it. Never edited, never deleted."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200, help_text="e.g. outbox.OutboundMessage:42")
    reason = models.TextField(blank=True)
    outcome = models.TextField(blank=True)
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.action} {self.target}"


class TriagePermissions(models.Model):
    """Holds the operators' custom permissions; it has no table of its own."""

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [
            ("retry_deadletter", "Can retry dead letters (one or in bulk)"),
            ("resolve_deadletter", "Can resolve, discard and assign dead letters"),
            ("decide_case", "Can decide reconciliation cases"),
            ("view_payload", "Can view full payloads and personal fields"),
            ("pause_circuit", "Can pause and resume bots and consumers"),
            ("view_dashboard", "Can view the operations dashboard"),
            ("cancel_message", "Can cancel waiting outbound messages and broadcasts"),
        ]

    def __str__(self) -> str:
        return "triage permissions"


class PayloadVersion(models.Model):
    """An operator's correction of an outbound message's payload. Version 1 keeps the
    original as it was; later versions are corrections. Rows are never edited."""

    message = models.ForeignKey("outbox.OutboundMessage", on_delete=models.CASCADE, related_name="payload_versions")
    number = models.PositiveIntegerField(help_text="1 is the original payload; each correction adds one.")
    payload = models.JSONField(help_text="The method's parameters as they were in this version.")
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="Who wrote this version (empty for the original).",
    )
    reason = models.TextField(blank=True, help_text="Why the payload was corrected.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["message_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["message", "number"], name="payloadversion_unique_number"),
        ]

    def __str__(self) -> str:
        return f"payload v{self.number} of message {self.message_id}"


class BulkState(models.TextChoices):
    RUNNING = "running", "releasing"
    CANCELLED = "cancelled", "cancelled"
    DONE = "done", "done"


class BulkRetry(models.Model):
    """A bulk retry of dead letters, released in growing batches by a task on the bulk queue."""

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reason = models.TextField(help_text="Why these dead letters are retried (the operator's words).")
    scope = models.CharField(max_length=300, blank=True, help_text="What was selected, e.g. a recover-since filter.")
    item_ids = models.JSONField(default=list, help_text="Dead letter ids in release order.")
    total = models.PositiveIntegerField(default=0)
    released = models.PositiveIntegerField(default=0, help_text="Items checked so far (the release cursor).")
    requeued = models.PositiveIntegerField(default=0)
    refused = models.PositiveIntegerField(default=0, help_text="Already delivered or done: not retried.")
    skipped = models.PositiveIntegerField(default=0, help_text="Stale or handled meanwhile: not retried.")
    state = models.CharField(max_length=16, choices=BulkState.choices, default=BulkState.RUNNING)
    first_batch = models.PositiveIntegerField(default=10, help_text="Size of the first, small batch.")
    max_batch = models.PositiveIntegerField(default=30, help_text="Cap per tick, from the bots' rate limits.")
    tick_seconds = models.FloatField(default=1.0, help_text="Pause between batches.")
    batches = models.JSONField(default=list, help_text="Sizes of the batches released so far.")
    reasons = models.JSONField(default=dict, help_text="Refused and skipped items counted by reason.")
    cancelled_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    ticked_at = models.DateTimeField(
        null=True, blank=True, help_text="When the last batch was released (the sweeper resumes a stalled one)."
    )
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "bulk retry"
        verbose_name_plural = "bulk retries"
        indexes = [
            models.Index(fields=["ticked_at"], name="bulkretry_running_idx", condition=models.Q(state="running"))
        ]

    def __str__(self) -> str:
        return f"bulk retry {self.pk} ({self.released}/{self.total}, {self.state})"


class SweeperLease(models.Model):
    """The one row saying which sweeper may sweep, and until when (reconciliation/sweeper.py).

    Taken and renewed by conditional UPDATEs, so it holds across transactions and through a
    transaction-pooling PgBouncer, unlike a session advisory lock."""

    holder = models.CharField(max_length=200, blank=True, help_text="host:pid:nonce of the sweeping process.")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Free after this (a killed sweeper's lease).")

    def __str__(self) -> str:
        return f"sweeper lease: {self.holder or 'free'}"
