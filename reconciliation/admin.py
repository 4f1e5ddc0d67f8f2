from django.contrib import admin

from reconciliation.models import AuditEntry, ReconciliationCase


@admin.register(ReconciliationCase)
class ReconciliationCaseAdmin(admin.ModelAdmin):
    list_display = ["id", "idempotency_key", "policy", "status", "decision", "decided_by", "created_at"]
    list_filter = ["status", "policy", "decision"]
    search_fields = ["idempotency_key"]
    raw_id_fields = ["message", "effect"]
    readonly_fields = [
        "message", "effect", "idempotency_key", "known_facts", "policy", "status", "decision", "decided_by",
        "decision_reason", "decided_at", "created_at",
    ]


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["created_at", "actor", "action", "target", "outcome"]
    list_filter = ["action"]
    search_fields = ["target", "reason"]
    readonly_fields = ["actor", "action", "target", "reason", "outcome", "details", "created_at"]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False
