"""Reconciliation cases: a send whose outcome is unknown, decided by an operator (mark
delivered, resend with the same key, or cancel)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path, reverse

from core.masking import for_user
from reconciliation import services
from reconciliation.admin.confirm import confirm_page
from reconciliation.admin.forms import MarkDeliveredForm, ReasonForm
from reconciliation.admin.permissions import DECIDE_PERMISSION
from reconciliation.models import CaseStatus, ReconciliationCase


@admin.register(ReconciliationCase)
class ReconciliationCaseAdmin(admin.ModelAdmin):
    list_display = ["id", "created_at", "idempotency_key", "policy", "status", "decision", "decided_by"]
    list_filter = ["status", "policy", "decision"]
    search_fields = ["=idempotency_key"]
    list_select_related = ["decided_by"]
    raw_id_fields = ["message", "effect"]
    readonly_fields = [
        "message",
        "effect",
        "idempotency_key",
        "known_facts",
        "policy",
        "status",
        "decision",
        "decided_by",
        "decision_reason",
        "decided_at",
        "created_at",
    ]
    change_form_template = "reconciliation/admin/case_change_form.html"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None) -> Any:
        case = self.get_object(request, object_id)
        extra = {
            "can_decide": case is not None
            and case.status == CaseStatus.OPEN
            and request.user.has_perm(DECIDE_PERMISSION)
        }
        if case is not None and case.message_id:
            extra["case_payload"] = for_user(request.user, case.message.payload)
            extra["case_attempts"] = list(case.message.attempt_set.all())
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("<int:pk>/decide/<str:decision>/", view(self.decide_view), name="reconciliation_case_decide"),
            *super().get_urls(),
        ]

    DECISIONS = {
        "mark_delivered": ("Mark delivered", "Telegram got it: the message becomes sent (nothing is sent again)."),
        "resend": (
            "Resend with the same key",
            "Queue it again with the same idempotency key; a duplicate is possible.",
        ),
        "cancel": ("Cancel", "Do not send again."),
    }

    def decide_view(self, request: HttpRequest, pk: int, decision: str) -> HttpResponse:
        case = get_object_or_404(ReconciliationCase, pk=pk)
        if decision not in self.DECISIONS:
            raise PermissionDenied
        if not (self.has_view_permission(request, case) and request.user.has_perm(DECIDE_PERMISSION)):
            raise PermissionDenied
        form_class = MarkDeliveredForm if decision == "mark_delivered" else ReasonForm
        form = form_class(request.POST or None)
        label, intro = self.DECISIONS[decision]
        if request.method == "POST" and form.is_valid():
            reason = form.cleaned_data["reason"]
            try:
                if decision == "mark_delivered":
                    services.case_mark_delivered(
                        case, request.user, reason, telegram_message_id=form.cleaned_data.get("telegram_message_id")
                    )
                elif decision == "resend":
                    services.case_resend(case, request.user, reason)
                else:
                    services.case_cancel(case, request.user, reason)
            except (services.CaseNotOpen, services.CaseSubjectChanged) as exc:
                services.audit_record(
                    actor=request.user,
                    action=f"reconciliation.{decision}",
                    target=f"reconciliation.ReconciliationCase:{case.pk}",
                    reason=reason,
                    outcome=f"refused: {exc}",
                )
                messages.error(request, f"Nothing done: {exc}.")
            else:
                self.log_change(request, case, f"{label}: {reason}")
                messages.success(request, f"Case {case.pk}: {label.lower()}.")
            return HttpResponseRedirect(reverse("admin:reconciliation_reconciliationcase_change", args=[case.pk]))
        return confirm_page(
            request,
            self,
            title=f"{label} — case {case.pk}",
            form=form,
            obj=case,
            intro=intro,
            submit=label,
            danger=decision != "mark_delivered",
        )
