from django import forms
from django.contrib import admin

from bots import registry
from bots.models import AnalyticsEvent, Bot, ChatState, ConsumerRun, InboundUpdate
from core.admin_tools import ExactSearchMixin, RedactedFieldsMixin, fixed_filter
from outbox.models import ErrorClass

# Telegram's update types and chat types: fixed lists, not a SELECT DISTINCT per page.
UPDATE_TYPES = [
    (t, t)
    for t in (
        "message",
        "edited_message",
        "channel_post",
        "edited_channel_post",
        "business_message",
        "callback_query",
        "inline_query",
        "chosen_inline_result",
        "shipping_query",
        "pre_checkout_query",
        "poll",
        "poll_answer",
        "my_chat_member",
        "chat_member",
        "chat_join_request",
        "message_reaction",
    )
]
CHAT_TYPES = [(t, t) for t in ("private", "group", "supergroup", "channel")]
UpdateTypeFilter = fixed_filter("update_type", UPDATE_TYPES, "update type")
# The registry's consumer names, not a SELECT DISTINCT over the runs (or the dead letters:
# reconciliation's admin filters them by it too).
ConsumerNameFilter = fixed_filter("consumer", lambda: [(n, n) for n in sorted(registry.registered())])
LastErrorClassFilter = fixed_filter("last_error_class", ErrorClass.choices, "last error class")
ChatTypeFilter = fixed_filter("chat_type", CHAT_TYPES, "chat type")

# The bot's credentials: write-only in the admin, never rendered back, shown as a hint.
SECRET_FIELDS = ("token", "webhook_secret")


def token_hint(token: str) -> str:
    """The bot's id (public: it is the bot's user id) and the token's last two characters."""
    if not token:
        return "not set"
    bot_id, _, rest = token.partition(":")
    return f"{bot_id}:…{rest[-2:]}" if rest else "set"


def secret_hint(secret: str) -> str:
    return f"set ({len(secret)} characters)" if secret else "not set"


class BotForm(forms.ModelForm):
    # Write-only: never rendered back after they are saved.
    token = forms.CharField(
        widget=forms.PasswordInput(render_value=False),
        required=False,
        help_text="Bot API token. Leave empty to keep the stored one; it is never shown.",
    )
    webhook_secret = forms.CharField(
        widget=forms.PasswordInput(render_value=False),
        required=False,
        max_length=256,
        validators=Bot._meta.get_field("webhook_secret").validators,
        help_text="Secret token Telegram sends with each update. Leave empty to keep the stored one; never shown.",
    )

    class Meta:
        model = Bot
        exclude: list[str] = []

    def clean_token(self) -> str:
        token = self.cleaned_data.get("token") or ""
        if not token:
            if self.instance.pk:
                return self.instance.token
            raise forms.ValidationError("A new bot needs a token.")
        return token

    def clean_webhook_secret(self) -> str:
        return self.cleaned_data.get("webhook_secret") or (self.instance.webhook_secret if self.instance.pk else "")


# Registered by reconciliation/admin/other_apps.py, which extends it (pause and resume, audit).
class BotAdmin(admin.ModelAdmin):
    form = BotForm
    list_display = ["name", "is_active", "responder", "rate_limit", "api_base_url", "created_at"]
    list_filter = ["is_active", "responder"]
    search_fields = ["name"]
    readonly_fields = ["token_hint", "webhook_secret_hint", "created_at", "updated_at", "polling_offset"]

    def get_fields(self, request, obj=None) -> list[str]:
        fields = list(super().get_fields(request, obj))
        if obj is not None and not self.has_change_permission(request, obj):
            # Read-only pages render every field's value: never the credentials themselves.
            fields = [f for f in fields if f not in SECRET_FIELDS]
        return fields

    @admin.display(description="token")
    def token_hint(self, obj: Bot) -> str:
        return token_hint(obj.token)

    @admin.display(description="webhook secret")
    def webhook_secret_hint(self, obj: Bot) -> str:
        return secret_hint(obj.webhook_secret)


# Registered by reconciliation/admin/other_apps.py, which extends it (payload masking by permission).
class InboundUpdateAdmin(ExactSearchMixin, RedactedFieldsMixin, admin.ModelAdmin):
    redacted_text_fields = ("last_error",)
    list_display = ["id", "bot", "update_id", "update_type", "chat_id", "state", "received_at", "processed_at"]
    list_filter = ["state", "bot", UpdateTypeFilter]
    search_fields = ["=chat_id", "=update_id", "=trace_id"]
    exact_text_fields = ("trace_id",)
    exact_int_fields = ("chat_id",)
    # update_id is unique per bot, indexed as (bot, update_id).
    exact_per_bot_fields = ("update_id",)
    list_select_related = ["bot"]
    readonly_fields = [f.name for f in InboundUpdate._meta.fields]
    # No date_hierarchy: its DATE_TRUNC queries scan the whole table on every page.

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(ConsumerRun)
class ConsumerRunAdmin(ExactSearchMixin, RedactedFieldsMixin, admin.ModelAdmin):
    redacted_text_fields = ("last_error",)
    list_display = [
        "id",
        "consumer",
        "bot",
        "update",
        "state",
        "attempts",
        "outcome",
        "last_error_class",
        "next_attempt_at",
    ]
    list_filter = ["state", ConsumerNameFilter, "bot", LastErrorClassFilter]
    search_fields = ["=trace_id"]
    exact_text_fields = ("trace_id",)
    list_select_related = ["bot", "update"]
    raw_id_fields = ["update"]
    readonly_fields = [f.name for f in ConsumerRun._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(ChatState)
class ChatStateAdmin(admin.ModelAdmin):
    list_display = ["bot", "chat_id", "last_answered_message_id", "last_answered_at"]
    list_filter = ["bot"]
    search_fields = ["=chat_id"]
    list_select_related = ["bot"]
    # The reply guard moves only forward, in bots/transitions.py.
    readonly_fields = [f.name for f in ChatState._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(AnalyticsEvent)
class AnalyticsEventAdmin(ExactSearchMixin, admin.ModelAdmin):
    list_display = ["received_at", "bot", "update_type", "chat_id", "chat_type", "latency_ms"]
    list_filter = ["bot", UpdateTypeFilter, ChatTypeFilter]
    search_fields = ["=chat_id"]
    exact_int_fields = ("chat_id",)
    list_select_related = ["bot"]
    raw_id_fields = ["update"]
    readonly_fields = [f.name for f in AnalyticsEvent._meta.fields]
    # No date_hierarchy: its DATE_TRUNC queries scan the whole table on every page.

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
