from typing import Any

from django.contrib import admin

from outbox.logging import redact, redact_json
from outbox.models import ApiClient, Attempt, Circuit, DeadLetter, Effect, OutboundMessage

# The permission that shows payloads in full (it lives in reconciliation; named, not imported).
PAYLOAD_PERMISSION = "reconciliation.view_payload"


def sees_payloads(request) -> bool:
    return bool(request is not None and request.user.has_perm(PAYLOAD_PERMISSION))


class RedactedFieldsMixin:
    """Error texts and results may echo what a person wrote or who they are (a CRM's or a
    model's answer quoting the lead, Telegram's result): without payload access they are
    shown redacted, as payloads are masked. `redacted_text_fields` and `redacted_json_fields`
    name them; each is replaced by a read-only `<name>_redacted` for such users."""

    redacted_text_fields: tuple[str, ...] = ()
    redacted_json_fields: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.redacted_text_fields:
            setattr(cls, f"{name}_redacted", _display(name, lambda v: redact(v or "")))
        for name in cls.redacted_json_fields:
            setattr(cls, f"{name}_redacted", _display(name, redact_json))

    def _redacted(self, request, names) -> list[str]:
        if sees_payloads(request):
            return list(names)
        hidden = {*self.redacted_text_fields, *self.redacted_json_fields}
        return [f"{name}_redacted" if name in hidden else name for name in names]

    def get_fields(self, request, obj=None):
        return self._redacted(request, super().get_fields(request, obj))

    def get_readonly_fields(self, request, obj=None):
        return self._redacted(request, super().get_readonly_fields(request, obj))


def _display(name: str, redact_value: Any) -> Any:
    def show(self: Any, obj: Any) -> Any:
        return redact_value(getattr(obj, name))

    show.short_description = name.replace("_", " ")
    return show


class AttemptInline(RedactedFieldsMixin, admin.TabularInline):
    model = Attempt
    redacted_text_fields = ("description",)
    extra = 0
    can_delete = False
    fields = [
        "number",
        "started_at",
        "finished_at",
        "worker",
        "outcome",
        "http_status",
        "error_code",
        "description",
        "retry_after",
    ]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(OutboundMessage)
class OutboundMessageAdmin(RedactedFieldsMixin, admin.ModelAdmin):
    redacted_text_fields = ("last_error",)
    redacted_json_fields = ("result",)
    list_display = [
        "id",
        "bot",
        "chat_id",
        "method",
        "state",
        "attempts",
        "last_error_class",
        "next_attempt_at",
        "created_at",
    ]
    list_filter = ["state", "bot", "method", "last_error_class"]
    search_fields = ["=chat_id", "idempotency_key", "trace_id"]
    list_select_related = ["bot"]
    raw_id_fields = ["source_update"]
    readonly_fields = [
        "state",
        "attempts",
        "lease_owner",
        "lease_expires_at",
        "last_error",
        "last_error_class",
        "telegram_message_id",
        "result",
        "sent_at",
        "created_at",
        "updated_at",
        "rate_limited_count",
        "payload_purged_at",
        "cancel_reason",
    ]
    inlines = [AttemptInline]
    date_hierarchy = "created_at"


@admin.register(DeadLetter)
class DeadLetterAdmin(RedactedFieldsMixin, admin.ModelAdmin):
    redacted_text_fields = ("first_error", "last_error")
    list_display = ["id", "bot", "reason_class", "consumer", "chat_id", "status", "owner", "created_at"]
    list_filter = ["status", "reason_class", "bot", "consumer"]
    search_fields = ["=chat_id", "trace_id", "idempotency_key"]
    list_select_related = ["bot", "owner"]
    raw_id_fields = ["message", "consumer_run", "owner"]
    readonly_fields = ["reason_class", "first_error", "last_error", "trace_id", "created_at", "resolved_at"]


@admin.register(Effect)
class EffectAdmin(RedactedFieldsMixin, admin.ModelAdmin):
    redacted_text_fields = ("last_error",)
    redacted_json_fields = ("result",)
    list_display = ["key", "state", "external_id", "attempts", "created_at", "done_at"]
    list_filter = ["state"]
    search_fields = ["key", "external_id", "trace_id"]
    readonly_fields = [f.name for f in Effect._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Circuit)
class CircuitAdmin(admin.ModelAdmin):
    """Read-only: an operator opens or closes a circuit with Pause and Resume on the bot's
    page, which ask for a reason and write the audit log; a bare edit here would not."""

    list_display = ["scope", "state", "manual", "consecutive_failures", "opened_at", "next_probe_at"]
    list_filter = ["state", "manual"]
    readonly_fields = ["state", "consecutive_failures", "opened_at", "next_probe_at", "updated_at"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ApiClient)
class ApiClientAdmin(admin.ModelAdmin):
    """Which bots each REST API client may use (`manage.py add_api_client` creates them)."""

    list_display = ["user", "payload_access", "created_at"]
    list_filter = ["payload_access"]
    search_fields = ["user__username"]
    filter_horizontal = ["bots"]
    raw_id_fields = ["user"]
