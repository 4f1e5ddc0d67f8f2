"""The audit log of operator actions: read-only, never edited or deleted."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.text import Truncator

from reconciliation.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["created_at", "actor", "action", "target", "reason_short", "outcome"]
    list_filter = ["action", ("actor", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["target", "reason", "outcome"]
    list_select_related = ["actor"]
    readonly_fields = ["actor", "action", "target", "reason", "outcome", "details", "created_at"]
    date_hierarchy = "created_at"

    @admin.display(description="reason")
    def reason_short(self, obj: AuditEntry) -> str:
        return Truncator(obj.reason).chars(60)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
