"""Dead-letter triage: the changelist with counts by reason, Retry (which checks the stored
idempotency key first), Resolve, Discard, bulk retry of a selection, Recover since, and a
CSV export masked without payload permission."""

from __future__ import annotations

import csv
import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.text import Truncator

from core.admin_tools import ExactSearchMixin, RedactedFieldsMixin
from core.logs import redact
from core.masking import can_view_payload, for_user
from outbox.models import DeadLetter, DeadLetterStatus, ErrorClass
from reconciliation import services, triage
from reconciliation.admin.confirm import confirm_page
from reconciliation.admin.filters import AgeBucketFilter, ConsumerFilter, KindFilter, OwnerFilter
from reconciliation.admin.forms import BulkRetryForm, DeadLetterForm, ReasonForm, RecoverSinceForm, RetryForm
from reconciliation.admin.permissions import RESOLVE_PERMISSION, RETRY_PERMISSION
from reconciliation.story import dead_letter_story


@admin.register(DeadLetter)
class TriageDeadLetterAdmin(ExactSearchMixin, RedactedFieldsMixin, admin.ModelAdmin):
    form = DeadLetterForm
    redacted_text_fields = ("first_error", "last_error")
    list_display = [
        "id",
        "created_at",
        "reason_badge",
        "bot",
        "kind",
        "consumer",
        "chat_id",
        "error_short",
        "status",
        "owner",
    ]
    list_display_links = ["id", "created_at"]
    list_filter = [
        "status",
        "reason_class",
        "bot",
        ConsumerFilter,
        KindFilter,
        AgeBucketFilter,
        OwnerFilter,
    ]
    # One box for chat id, trace id and idempotency key, exactly (ExactSearchMixin).
    search_fields = ["=chat_id", "=trace_id", "=idempotency_key"]
    exact_text_fields = ("trace_id", "idempotency_key")
    exact_int_fields = ("chat_id",)
    list_select_related = ["bot", "owner"]
    ordering = ["-created_at", "-id"]
    actions = ["bulk_retry_action", "export_csv"]
    change_list_template = "reconciliation/admin/deadletter_change_list.html"
    change_form_template = "reconciliation/admin/deadletter_change_form.html"
    fields = [
        "owner",
        "status",
        "reason_class",
        "bot",
        "subject",
        "consumer",
        "chat_id",
        "idempotency_key",
        "trace_id",
        "first_error",
        "last_error",
        "resolution_note",
        "created_at",
        "resolved_at",
    ]
    readonly_fields = [f for f in fields if f != "owner"]

    @admin.display(description="reason", ordering="reason_class")
    def reason_badge(self, obj: DeadLetter) -> str:
        return format_html(
            "<span class='dovecote-reason dovecote-reason-{}'>{}</span>",
            obj.reason_class,
            obj.get_reason_class_display(),
        )

    @admin.display(description="kind")
    def kind(self, obj: DeadLetter) -> str:
        return "message" if obj.message_id else "consumer run"

    @admin.display(description="subject")
    def subject(self, obj: DeadLetter) -> str:
        if obj.message_id:
            url = reverse("admin:outbox_outboundmessage_change", args=[obj.message_id])
            return format_html("<a href='{}'>outbound message {}</a>", url, obj.message_id)
        url = reverse("admin:bots_consumerrun_change", args=[obj.consumer_run_id])
        return format_html("<a href='{}'>consumer run {}</a>", url, obj.consumer_run_id)

    @admin.display(description="last error")
    def error_short(self, obj: DeadLetter) -> str:
        # The changelist has no request here: the short form is always redacted.
        return Truncator(redact(obj.last_error)).chars(80)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # history is never rewritten: resolve or discard instead

    def save_model(self, request: HttpRequest, obj: DeadLetter, form: forms.ModelForm, change: bool) -> None:
        # Only the owner is editable; the change goes through the service (and the audit log).
        if "owner" in form.changed_data:
            triage.dead_letter_assign(obj, request.user, obj.owner)

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        counts = (
            DeadLetter.objects.filter(status=DeadLetterStatus.OPEN)
            .values("reason_class")
            .annotate(n=Count("id"))
            .order_by("-n")
        )
        labels = dict(ErrorClass.choices)
        extra = {
            "reason_counts": [
                {
                    "reason": row["reason_class"],
                    "label": labels.get(row["reason_class"], row["reason_class"]),
                    "n": row["n"],
                }
                for row in counts
            ],
            "can_retry": request.user.has_perm(RETRY_PERMISSION),
        }
        return super().changelist_view(request, {**(extra_context or {}), **extra})

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None) -> Any:
        letter = self.get_object(request, object_id)
        extra: dict[str, Any] = {}
        if letter is not None:
            is_open = letter.status == DeadLetterStatus.OPEN
            extra = {
                "story": dead_letter_story(letter, user=request.user),
                "can_view_payload": can_view_payload(request.user),
                "can_retry": is_open and request.user.has_perm(RETRY_PERMISSION),
                "can_resolve": is_open and request.user.has_perm(RESOLVE_PERMISSION),
                "retry_check": triage.dead_letter_check(letter) if is_open else None,
            }
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("<int:pk>/retry/", view(self.retry_view), name="outbox_deadletter_retry"),
            path("<int:pk>/resolve/", view(self.resolve_view), name="outbox_deadletter_resolve"),
            path("<int:pk>/discard/", view(self.discard_view), name="outbox_deadletter_discard"),
            path("recover/", view(self.recover_view), name="outbox_deadletter_recover"),
            *super().get_urls(),
        ]

    def _letter(self, request: HttpRequest, pk: int, permission: str) -> DeadLetter:
        letter = get_object_or_404(DeadLetter.objects.select_related("bot", "message"), pk=pk)
        if not (self.has_view_permission(request, letter) and request.user.has_perm(permission)):
            raise PermissionDenied
        return letter

    def _back(self, letter: DeadLetter) -> HttpResponseRedirect:
        return HttpResponseRedirect(reverse("admin:outbox_deadletter_change", args=[letter.pk]))

    def retry_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        letter = self._letter(request, pk, RETRY_PERMISSION)
        editable = bool(letter.message_id) and can_view_payload(request.user)
        initial = (
            {"corrected_payload": json.dumps(letter.message.payload, indent=2, ensure_ascii=False)}
            if (editable)
            else {}
        )
        form = RetryForm(request.POST or None, initial=initial)
        if not editable:
            del form.fields["corrected_payload"]
        if request.method == "POST" and form.is_valid():
            corrected = form.cleaned_data.get("corrected_payload")
            if corrected == (letter.message.payload if letter.message_id else None):
                corrected = None  # unchanged: not a correction
            try:
                result = triage.dead_letter_retry(letter, request.user, form.cleaned_data["reason"], corrected)
            except triage.TriageError as exc:
                form.add_error(None, str(exc))
            else:
                self.log_change(request, letter, f"retry: {result}")
                level = messages.SUCCESS if result.requeued else messages.WARNING
                messages.add_message(request, level, f"Dead letter {letter.pk} {result}.")
                return self._back(letter)
        check = triage.dead_letter_check(letter)
        intro = (
            "Checks the stored idempotency key and the current state first, then requeues the same "
            f"{'message' if letter.message_id else 'consumer run'} with the same key "
            f"({letter.idempotency_key})."
        )
        if check is not None:
            intro += f" Right now it would be {check}."
        return confirm_page(
            request,
            self,
            title=f"Retry dead letter {letter.pk}",
            form=form,
            obj=letter,
            intro=intro,
            submit="Retry with the same key",
        )

    def resolve_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        return self._close_view(request, pk, resolve=True)

    def discard_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        return self._close_view(request, pk, resolve=False)

    def _close_view(self, request: HttpRequest, pk: int, *, resolve: bool) -> HttpResponse:
        letter = self._letter(request, pk, RESOLVE_PERMISSION)
        form = ReasonForm(request.POST or None)
        verb = "resolve" if resolve else "discard"
        if request.method == "POST" and form.is_valid():
            service = triage.dead_letter_resolve if resolve else triage.dead_letter_discard
            if service(letter, request.user, form.cleaned_data["reason"]):
                self.log_change(request, letter, f"{verb}d: {form.cleaned_data['reason']}")
                messages.success(request, f"Dead letter {letter.pk} {verb}d.")
            else:
                messages.warning(request, f"Dead letter {letter.pk} is not open any more; nothing changed.")
            return self._back(letter)
        intro = "Handled by hand: it will not be retried." if resolve else "Not worth doing: it will not be retried."
        return confirm_page(
            request,
            self,
            title=f"{verb.capitalize()} dead letter {letter.pk}",
            form=form,
            obj=letter,
            intro=intro,
            submit=verb.capitalize(),
            danger=not resolve,
        )

    @admin.action(description="Retry selected dead letters (checked, in batches)")
    def bulk_retry_action(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        if not request.user.has_perm(RETRY_PERMISSION):
            raise PermissionDenied
        form = BulkRetryForm(request.POST if "confirm" in request.POST else None)
        if form.is_valid():
            bulk = triage.bulk_retry_start(
                queryset, request.user, form.cleaned_data["reason"], scope=f"admin selection of {queryset.count()}"
            )
            self.message_user(
                request,
                f"Bulk retry {bulk.pk} started: {bulk.total} dead letters, first batch "
                f"{bulk.first_batch}, at most {bulk.max_batch} per {bulk.tick_seconds:g}s.",
            )
            return HttpResponseRedirect(reverse("admin:reconciliation_bulkretry_change", args=[bulk.pk]))
        by_reason = queryset.values("reason_class").annotate(n=Count("id")).order_by("-n")
        return confirm_page(
            request,
            self,
            title=f"Retry {queryset.count()} dead letters",
            form=form,
            intro="Each one passes the same checks as a single Retry; they are released in growing batches "
            "within the bots' rate limits, on the bulk queue.",
            submit="Start bulk retry",
            extra={
                "action": "bulk_retry_action",
                "selected": [str(pk) for pk in queryset.values_list("pk", flat=True)],
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
                "by_reason": list(by_reason),
            },
        )

    @admin.action(description="Export selected as CSV (masked without payload permission)", permissions=["view"])
    def export_csv(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse:
        """Each cell as the dead letter's page shows it to this user: payload and error texts
        masked without payload access."""
        response = HttpResponse(content_type="text/csv")
        response["Content-Disposition"] = 'attachment; filename="dead-letters.csv"'
        writer = csv.writer(response)
        writer.writerow(
            [
                "id",
                "created_at",
                "reason",
                "bot",
                "consumer",
                "chat_id",
                "status",
                "idempotency_key",
                "trace_id",
                "last_error",
                "payload",
            ]
        )
        for letter in queryset.select_related("bot", "message"):
            payload = for_user(request.user, letter.message.payload) if letter.message_id else ""
            writer.writerow(
                [
                    letter.pk,
                    letter.created_at.isoformat(),
                    letter.reason_class,
                    letter.bot.name,
                    letter.consumer,
                    letter.chat_id,
                    letter.status,
                    letter.idempotency_key,
                    letter.trace_id,
                    self.shown(request, letter, "last_error"),
                    json.dumps(payload, ensure_ascii=False) if payload else "",
                ]
            )
        services.audit_record(
            actor=request.user,
            action="deadletter.export",
            target="outbox.DeadLetter",
            outcome=f"exported {queryset.count()} rows",
            details={"masked": not can_view_payload(request.user)},
        )
        return response

    def recover_view(self, request: HttpRequest) -> HttpResponse:
        if not request.user.has_perm(RETRY_PERMISSION):
            raise PermissionDenied
        form = RecoverSinceForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            bulk = triage.recover_since(
                user=request.user,
                reason=data["reason"],
                since=data["since"],
                reason_class=data["reason_class"],
                bot_id=data["bot"].pk if data["bot"] else None,
                consumer=data["consumer"].strip(),
            )
            self.message_user(request, f"Recover since: bulk retry {bulk.pk} started over {bulk.total} dead letters.")
            return HttpResponseRedirect(reverse("admin:reconciliation_bulkretry_change", args=[bulk.pk]))
        return confirm_page(
            request,
            self,
            title="Recover since",
            form=form,
            intro="After an outage is fixed: requeue every open dead letter of one reason since a time, for a bot or "
            "a consumer, with the same checks and batching as any bulk retry.",
            submit="Start recovery",
        )
