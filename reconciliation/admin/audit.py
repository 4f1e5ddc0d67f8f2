"""The audit log of operator actions: read-only, never edited or deleted."""

from __future__ import annotations

from django.contrib import admin
from django.utils.text import Truncator

from core.admin_tools import ReadOnlyAdmin
from reconciliation.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "actor", "action", "target", "reason_short", "outcome"]
    list_filter = ["action", ("actor", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["target", "reason", "outcome"]
    list_select_related = ["actor"]
    readonly_fields = ["actor", "action", "target", "reason", "outcome", "details", "created_at"]
    date_hierarchy = "created_at"

    @admin.display(description="reason")
    def reason_short(self, obj: AuditEntry) -> str:
        return Truncator(obj.reason).chars(60)
