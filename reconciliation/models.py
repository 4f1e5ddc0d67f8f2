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
