"""Bulk retries of dead letters: their progress, and Cancel for the rest of a running one."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils.html import format_html

from reconciliation import triage
from reconciliation.admin.confirm import confirm_page
from reconciliation.admin.forms import ReasonForm
from reconciliation.admin.permissions import RETRY_PERMISSION
from reconciliation.models import BulkRetry


@admin.register(BulkRetry)
class BulkRetryAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "created_at",
        "created_by",
        "state",
        "total",
        "released",
        "requeued",
        "refused",
        "skipped",
        "scope",
    ]
    list_filter = ["state"]
    readonly_fields = [
        "created_by",
        "reason",
        "scope",
        "state",
        "total",
        "released",
        "requeued",
        "refused",
        "skipped",
        "first_batch",
        "max_batch",
        "tick_seconds",
        "batches",
        "summary",
        "cancelled_by",
        "created_at",
        "finished_at",
    ]
    exclude = ["item_ids", "reasons"]
    change_form_template = "reconciliation/admin/bulkretry_change_form.html"

    @admin.display(description="refused and skipped, by reason")
    def summary(self, obj: BulkRetry) -> str:
        rows = sorted(obj.reasons.items(), key=lambda kv: -kv[1])
        return format_html("<pre>{}</pre>", "\n".join(f"{n:>6}  {k}" for k, n in rows) or "-")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("<int:pk>/cancel/", view(self.cancel_view), name="reconciliation_bulkretry_cancel"),
            *super().get_urls(),
        ]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None) -> Any:
        extra = {"can_cancel": request.user.has_perm(RETRY_PERMISSION)}
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def cancel_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        bulk = get_object_or_404(BulkRetry, pk=pk)
        if not request.user.has_perm(RETRY_PERMISSION):
            raise PermissionDenied
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            if triage.bulk_retry_cancel(bulk, request.user, form.cleaned_data["reason"]):
                self.log_change(request, bulk, "cancelled")
                messages.success(request, f"Bulk retry {bulk.pk} cancelled: {triage.bulk_summary(bulk)}.")
            else:
                messages.warning(request, f"Bulk retry {bulk.pk} was not releasing any more.")
            return HttpResponseRedirect(reverse("admin:reconciliation_bulkretry_change", args=[bulk.pk]))
        return confirm_page(
            request,
            self,
            title=f"Cancel bulk retry {bulk.pk}",
            form=form,
            obj=bulk,
            intro=f"{triage.bulk_summary(bulk)}. Items already requeued stay requeued.",
            submit="Cancel the rest",
            danger=True,
        )
