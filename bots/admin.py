from django import forms
from django.contrib import admin

from bots.models import AnalyticsEvent, Bot, ChatState, ConsumerRun, InboundUpdate


class BotForm(forms.ModelForm):
    # The token is write-only: never rendered back after it is saved.
    token = forms.CharField(
        widget=forms.PasswordInput(render_value=False),
        required=False,
        help_text="Bot API token. Leave empty to keep the stored one; it is never shown.",
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


@admin.register(Bot)
class BotAdmin(admin.ModelAdmin):
    form = BotForm
    list_display = ["name", "is_active", "responder", "rate_limit", "api_base_url", "created_at"]
    list_filter = ["is_active", "responder"]
    search_fields = ["name"]
    readonly_fields = ["created_at", "updated_at", "polling_offset"]


@admin.register(InboundUpdate)
class InboundUpdateAdmin(admin.ModelAdmin):
    list_display = ["id", "bot", "update_id", "update_type", "chat_id", "state", "received_at", "processed_at"]
    list_filter = ["state", "bot", "update_type"]
    search_fields = ["=chat_id", "=update_id", "trace_id"]
    list_select_related = ["bot"]
    readonly_fields = [f.name for f in InboundUpdate._meta.fields]
    date_hierarchy = "received_at"

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(ConsumerRun)
class ConsumerRunAdmin(admin.ModelAdmin):
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
    list_filter = ["state", "consumer", "bot", "last_error_class"]
    search_fields = ["trace_id", "consumer"]
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
class AnalyticsEventAdmin(admin.ModelAdmin):
    list_display = ["received_at", "bot", "update_type", "chat_id", "chat_type", "latency_ms"]
    list_filter = ["bot", "update_type", "chat_type"]
    search_fields = ["=chat_id"]
    list_select_related = ["bot"]
    raw_id_fields = ["update"]
    readonly_fields = [f.name for f in AnalyticsEvent._meta.fields]
    date_hierarchy = "received_at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
