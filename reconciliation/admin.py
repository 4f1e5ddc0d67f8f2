"""The operators' back office: dead-letter triage with a safe Retry, bulk retry and recover
since, reconciliation decisions, read-only audit, masked payloads, bot pause/resume.

Every button follows Django's own pattern: object-tools link -> confirmation page with a
required reason -> POST with CSRF -> view wrapped in admin_view -> object and custom
permission checks -> triage service -> log_change + AuditEntry -> message -> redirect.
The dead-letter, message, update and bot admins of outbox/bots are re-registered here,
because their buttons call reconciliation services (which outbox and bots cannot import).
"""

from __future__ import annotations

import csv
import json
from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.text import Truncator

from bots.admin import BotAdmin, InboundUpdateAdmin
from bots.models import Bot, InboundUpdate
from bots.payloads import clip
from outbox import services as outbox_services
from outbox.admin import CappedCountPaginator, ConsumerNameFilter, OutboundMessageAdmin, RedactedFieldsMixin
from outbox.circuits import bot_scope
from outbox.logs import redact
from outbox.models import DeadLetter, DeadLetterStatus, ErrorClass, OutboundMessage, State
from reconciliation import services, triage
from reconciliation.masking import can_view_payload, for_user, mask
from reconciliation.models import AuditEntry, BulkRetry, CaseStatus, PayloadVersion, ReconciliationCase
from reconciliation.story import dead_letter_story

RETRY_PERMISSION = "reconciliation.retry_deadletter"
RESOLVE_PERMISSION = "reconciliation.resolve_deadletter"
DECIDE_PERMISSION = "reconciliation.decide_case"
PAUSE_PERMISSION = "reconciliation.pause_circuit"
CANCEL_PERMISSION = "reconciliation.cancel_message"
WAITING_STATES = (State.PENDING, State.RETRY)
CONFIRM_TEMPLATE = "reconciliation/admin/confirm.html"


def _pretty(value: Any) -> str:
    return format_html("<pre class='dovecote-json'>{}</pre>", json.dumps(value, indent=2, ensure_ascii=False))


def _mark_viewer(request: HttpRequest, obj: Any) -> Any:
    # Stored on the object, not on the (shared, multi-threaded) ModelAdmin instance.
    if obj is not None:
        obj._dovecote_payload_visible = can_view_payload(request.user)
    return obj


def _payload_for(obj: Any, payload: Any) -> str:
    visible = getattr(obj, "_dovecote_payload_visible", False)
    # Clipped at any depth: json.dumps with an indent recurses once per level.
    return _pretty(clip(payload) if visible else mask(payload))


def confirm_page(
    request: HttpRequest,
    model_admin: admin.ModelAdmin,
    *,
    title: str,
    form: forms.Form,
    obj: Any = None,
    intro: str = "",
    submit: str = "Confirm",
    danger: bool = False,
    extra: dict[str, Any] | None = None,
) -> TemplateResponse:
    """The confirmation step of every operator action: a form that POSTs with CSRF."""
    context = {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "intro": intro,
        "form": form,
        "object": obj,
        "opts": model_admin.model._meta,
        "submit_label": submit,
        "danger": danger,
        "cancel_url": request.META.get("HTTP_REFERER") or "..",
        **(extra or {}),
    }
    return TemplateResponse(request, CONFIRM_TEMPLATE, context)


# --- forms ------------------------------------------------------------------------------


class ReasonForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}), help_text="Required. Kept in the audit log."
    )


class RetryForm(ReasonForm):
    corrected_payload = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 8, "cols": 60, "class": "vLargeTextField"}),
        help_text="Edit and retry: a corrected payload as a JSON object. Saved as a new version; the original stays.",
    )

    def clean_corrected_payload(self) -> dict[str, Any] | None:
        raw = (self.cleaned_data.get("corrected_payload") or "").strip()
        if not raw:
            return None
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise forms.ValidationError("the payload must be a JSON object")
        return value


class BulkRetryForm(ReasonForm):
    pass


class RecoverSinceForm(ReasonForm):
    bot = forms.ModelChoiceField(queryset=Bot.objects.all(), required=False)
    consumer = forms.CharField(required=False, help_text="A consumer name; with or without a bot.")
    reason_class = forms.ChoiceField(choices=ErrorClass.choices, label="Dead-letter reason")
    since = forms.DateTimeField(
        help_text="Dead letters created at or after this time (YYYY-MM-DD HH:MM, server time zone).",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if not data.get("bot") and not data.get("consumer"):
            raise forms.ValidationError("Choose a bot or a consumer.")
        return data


class MarkDeliveredForm(ReasonForm):
    telegram_message_id = forms.IntegerField(
        required=False, min_value=1, help_text="Telegram's message id, if you found the message in the chat."
    )


# --- filters ----------------------------------------------------------------------------


class AgeBucketFilter(admin.SimpleListFilter):
    title = "age"
    parameter_name = "age"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("1h", "under 1 hour"), ("today", "today"), ("week", "this week"), ("older", "older")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet | None:
        now = timezone.now()
        start_of_day = timezone.localtime(now).replace(hour=0, minute=0, second=0, microsecond=0)
        bounds = {
            "1h": (now - timedelta(hours=1), None),
            "today": (start_of_day, None),
            "week": (now - timedelta(days=7), None),
            "older": (None, now - timedelta(days=7)),
        }
        if self.value() not in bounds:
            return None
        after, before = bounds[self.value()]
        if after is not None:
            queryset = queryset.filter(created_at__gte=after)
        if before is not None:
            queryset = queryset.filter(created_at__lt=before)
        return queryset


# The registry's consumer names, not a SELECT DISTINCT over the dead letters.
ConsumerFilter = ConsumerNameFilter


class KindFilter(admin.SimpleListFilter):
    title = "kind"
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("message", "outbox message"), ("run", "consumer run")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet | None:
        if self.value() == "message":
            return queryset.filter(message__isnull=False)
        if self.value() == "run":
            return queryset.filter(consumer_run__isnull=False)
        return None


# --- dead letters -----------------------------------------------------------------------


class DeadLetterForm(forms.ModelForm):
    class Meta:
        model = DeadLetter
        fields = ["owner"]


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


class TriageDeadLetterAdmin(RedactedFieldsMixin, admin.ModelAdmin):
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
    list_filter = ["status", "reason_class", "bot", ConsumerFilter, KindFilter, AgeBucketFilter, "owner"]
    search_fields = ["=chat_id", "=trace_id", "=idempotency_key"]
    list_select_related = ["bot", "owner"]
    ordering = ["-created_at", "-id"]
    show_full_result_count = False
    paginator = CappedCountPaginator
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

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        # One box for chat id, trace id and idempotency key; a non-number never hits chat_id.
        matches = queryset.filter(trace_id=term) | queryset.filter(idempotency_key=term)
        if term.lstrip("-").isdigit() and abs(int(term)) < 2**63:
            matches |= queryset.filter(chat_id=int(term))
        return matches, False

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

    @admin.action(description="Export selected as CSV (masked without payload permission)")
    def export_csv(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse:
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
                    letter.last_error,
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


# --- masked views of payloads -----------------------------------------------------------


class MaskedOutboundMessageAdmin(OutboundMessageAdmin):
    """Payload read-only (corrections go through edit-and-retry) and masked without permission.
    Cancel (this message) and Cancel broadcast (every waiting message with its broadcast key)."""

    change_form_template = "reconciliation/admin/outboundmessage_change_form.html"

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None) -> Any:
        message = OutboundMessage.objects.filter(pk=object_id).only("state", "broadcast").first()
        may = message is not None and request.user.has_perm(CANCEL_PERMISSION)
        extra = {
            "can_cancel": may and message.state in WAITING_STATES,
            "can_cancel_broadcast": may and bool(message.broadcast),
        }
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("<int:pk>/cancel/", view(self.cancel_view), name="outbox_outboundmessage_cancel"),
            path(
                "<int:pk>/cancel-broadcast/",
                view(self.cancel_broadcast_view),
                name="outbox_outboundmessage_cancel_broadcast",
            ),
            *super().get_urls(),
        ]

    def _message(self, request: HttpRequest, pk: int) -> OutboundMessage:
        message = get_object_or_404(OutboundMessage.objects.select_related("bot"), pk=pk)
        if not (self.has_view_permission(request, message) and request.user.has_perm(CANCEL_PERMISSION)):
            raise PermissionDenied
        return message

    def _back(self, message: OutboundMessage) -> HttpResponseRedirect:
        return HttpResponseRedirect(reverse("admin:outbox_outboundmessage_change", args=[message.pk]))

    def cancel_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        message = self._message(request, pk)
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            reason = form.cleaned_data["reason"]
            ok = outbox_services.outbound_message_cancel(message.pk, reason=f"cancelled by {request.user}: {reason}")
            outcome = "cancelled" if ok else "not waiting any more; nothing changed"
            services.audit_record(
                actor=request.user,
                action="message.cancel",
                target=f"outbox.OutboundMessage:{message.pk}",
                reason=reason,
                outcome=outcome,
            )
            if ok:
                self.log_change(request, message, f"cancelled: {reason}")
                messages.success(request, f"Message {message.pk} cancelled.")
            else:
                messages.warning(request, f"Message {message.pk} is not waiting any more; nothing changed.")
            return self._back(message)
        return confirm_page(
            request,
            self,
            title=f"Cancel message {message.pk}",
            form=form,
            obj=message,
            intro=f"{message.method} to chat {message.chat_id}, {message.get_state_display()}: it will not be sent. "
            "A message already being sent cannot be cancelled.",
            submit="Cancel the message",
            danger=True,
        )

    def cancel_broadcast_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        message = self._message(request, pk)
        if not message.broadcast:
            raise PermissionDenied
        waiting = OutboundMessage.objects.filter(
            bot_id=message.bot_id, broadcast=message.broadcast, state__in=WAITING_STATES
        )
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            reason = form.cleaned_data["reason"]
            n = outbox_services.outbound_broadcast_cancel(
                bot_id=message.bot_id, broadcast=message.broadcast, reason=f"cancelled by {request.user}: {reason}"
            )
            services.audit_record(
                actor=request.user,
                action="broadcast.cancel",
                target=f"outbox.broadcast:{message.bot_id}:{message.broadcast}",
                reason=reason,
                outcome=f"{n} waiting messages cancelled",
                details={"bot": message.bot_id, "broadcast": message.broadcast, "cancelled": n},
            )
            self.log_change(request, message, f"broadcast {message.broadcast} cancelled ({n} messages): {reason}")
            messages.success(request, f"Broadcast {message.broadcast}: {n} waiting messages cancelled.")
            return self._back(message)
        return confirm_page(
            request,
            self,
            title=f"Cancel broadcast {message.broadcast}",
            form=form,
            obj=message,
            intro=f"{waiting.count()} messages of bot {message.bot} in this broadcast are still waiting: none of them "
            "will be sent. Messages already sent or being sent stay as they are.",
            submit="Cancel the broadcast",
            danger=True,
        )

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = [f for f in super().get_fields(request, obj) if f != "payload"]
        return [*fields, "payload_view"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is None:
            return [*super().get_readonly_fields(request, obj), "payload_view"]
        return [f.name for f in OutboundMessage._meta.fields if f.name != "payload"] + ["payload_view"]

    @admin.display(description="payload")
    def payload_view(self, obj: OutboundMessage) -> str:
        return _payload_for(obj, obj.payload)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        return _mark_viewer(request, super().get_object(request, object_id, from_field))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # messages come through the API or consumers, with a key


class MaskedInboundUpdateAdmin(InboundUpdateAdmin):
    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f for f in super().get_readonly_fields(request, obj) if f != "payload"] + ["payload_view"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f for f in super().get_fields(request, obj) if f != "payload"] + ["payload_view"]

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        return _mark_viewer(request, super().get_object(request, object_id, from_field))

    @admin.display(description="payload")
    def payload_view(self, obj: InboundUpdate) -> str:
        return _payload_for(obj, obj.payload)


@admin.register(PayloadVersion)
class PayloadVersionAdmin(admin.ModelAdmin):
    list_display = ["message", "number", "author", "reason", "created_at"]
    raw_id_fields = ["message"]
    fields = ["message", "number", "author", "reason", "created_at", "payload_view"]
    readonly_fields = fields

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        return _mark_viewer(request, super().get_object(request, object_id, from_field))

    @admin.display(description="payload")
    def payload_view(self, obj: PayloadVersion) -> str:
        return _payload_for(obj, obj.payload)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# --- bots: pause / resume ---------------------------------------------------------------


class OperatorBotAdmin(BotAdmin):
    change_form_template = "reconciliation/admin/bot_change_form.html"

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None) -> Any:
        from outbox.models import Circuit

        scope = bot_scope(int(object_id)) if object_id.isdigit() else ""
        circuit = Circuit.objects.filter(scope=scope).first()
        extra = {
            "circuit": circuit,
            "can_pause": request.user.has_perm(PAUSE_PERMISSION),
            "circuit_scope": scope,
        }
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """A credential change is audited (which one, by whom), never its value."""
        before = Bot.objects.filter(pk=obj.pk).values("token", "webhook_secret").first() if change else None
        super().save_model(request, obj, form, change)
        if before is None:
            return
        changed = [name for name in ("token", "webhook_secret") if before[name] != getattr(obj, name)]
        if changed:
            services.audit_record(
                actor=request.user,
                action="bot.credentials_changed",
                target=f"bots.Bot:{obj.pk}",
                outcome="changed: " + ", ".join(changed),
                details={"fields": changed},
            )


# --- reconciliation cases ---------------------------------------------------------------


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


# The operators' admins of other apps' models, each registered once, here: the apps define
# the base classes (bots/admin.py, outbox/admin.py) and register none of these four.
admin.site.register(DeadLetter, TriageDeadLetterAdmin)
admin.site.register(OutboundMessage, MaskedOutboundMessageAdmin)
admin.site.register(InboundUpdate, MaskedInboundUpdateAdmin)
admin.site.register(Bot, OperatorBotAdmin)
