from django.contrib import admin

from core.admin_tools import ExactSearchMixin, ReadOnlyAdmin, RedactedFieldsMixin, fixed_filter
from outbox.models import ApiClient, Attempt, Circuit, Effect, ErrorClass


def _methods() -> list[tuple[str, str]]:
    from outbox.methods import SUPPORTED_METHODS

    return [(m, m) for m in sorted(SUPPORTED_METHODS)]


MethodFilter = fixed_filter("method", _methods)
LastErrorClassFilter = fixed_filter("last_error_class", ErrorClass.choices, "last error class")


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


# Registered by reconciliation/admin/other_apps.py, which extends it (payload masking by permission).
class OutboundMessageAdmin(ExactSearchMixin, RedactedFieldsMixin, admin.ModelAdmin):
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
    list_filter = ["state", "bot", MethodFilter, LastErrorClassFilter]
    # Chat id, idempotency key or trace id, exactly (ExactSearchMixin).
    search_fields = ["=chat_id", "=idempotency_key", "=trace_id"]
    exact_text_fields = ("trace_id",)
    exact_per_bot_fields = ("idempotency_key",)
    exact_int_fields = ("chat_id", "id")
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
    # No date_hierarchy: its DATE_TRUNC queries scan the whole table on every page.


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
class CircuitAdmin(ReadOnlyAdmin):
    """Read-only: an operator opens or closes a circuit with Pause and Resume on the bot's
    page, which ask for a reason and write the audit log; a bare edit here would not."""

    list_display = ["scope", "state", "manual", "consecutive_failures", "opened_at", "next_probe_at"]
    list_filter = ["state", "manual"]
    readonly_fields = ["state", "consecutive_failures", "opened_at", "next_probe_at", "updated_at"]


@admin.register(ApiClient)
class ApiClientAdmin(admin.ModelAdmin):
    """Which bots each REST API client may use (`manage.py add_api_client` creates them)."""

    list_display = ["user", "payload_access", "created_at"]
    list_filter = ["payload_access"]
    search_fields = ["user__username"]
    filter_horizontal = ["bots"]
    raw_id_fields = ["user"]
