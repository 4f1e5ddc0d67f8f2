"""REST API input and output shapes. Validation here is about form; the services decide
what may be sent (and raise MessageRejected, which views turn into field errors)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from outbox import selectors, services
from outbox.methods import SUPPORTED_METHODS
from outbox.models import Attempt, OnAmbiguous, OutboundMessage, State

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_BROADCAST_CHATS = 10_000
MAX_LIST_PAGE = 200


def _bot_model() -> Any:
    # outbox does not import bots (dependencies run reconciliation -> bots -> outbox).
    return OutboundMessage._meta.get_field("bot").related_model


def bot_named(name: Any) -> Any:
    """The bot called `name`, or None, whatever `name` is (a NUL is in no bot's name, and
    PostgreSQL's text cannot even be asked about it)."""
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or "\x00" in name:
        return None
    return _bot_model().objects.filter(name=name).first()


@extend_schema_field(OpenApiTypes.STR)
class BotNameField(serializers.Field):
    """A bot by name; unknown or inactive names are a 400 with a clear message."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str) or not 1 <= len(data) <= 64:
            raise serializers.ValidationError("a bot name is a string of 1-64 characters")
        name = data
        bot = bot_named(name)
        if bot is None:
            raise serializers.ValidationError(f"unknown bot {name!r}")
        if not bot.is_active:
            raise serializers.ValidationError(f"bot {name!r} is inactive")
        return bot

    def to_representation(self, value: Any) -> str:
        return value.name


class _SendOptions(serializers.Serializer):
    bot = BotNameField(help_text="The bot's name (manage.py add_bot NAME).")
    method = serializers.ChoiceField(
        choices=sorted(SUPPORTED_METHODS), default="sendMessage", help_text="Bot API method."
    )
    payload = serializers.DictField(
        default=dict, help_text="The method's other parameters (text, parse_mode, reply_markup, ...)."
    )
    send_at = serializers.DateTimeField(required=False, allow_null=True, help_text="Not sent before this time.")
    expires_at = serializers.DateTimeField(
        required=False, allow_null=True, help_text="Cancelled (with a reason) if not sent by then."
    )
    on_ambiguous = serializers.ChoiceField(
        choices=OnAmbiguous.choices,
        default=OnAmbiguous.HOLD,
        help_text="hold: an unknown outcome waits for an operator; resend: resent (a duplicate is possible).",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        send_at, expires_at = attrs.get("send_at"), attrs.get("expires_at")
        if send_at and expires_at and expires_at <= send_at:
            raise serializers.ValidationError({"expires_at": ["must be after send_at"]})
        return attrs


class MessageCreateSerializer(_SendOptions):
    chat_id = serializers.IntegerField(min_value=INT64_MIN, max_value=INT64_MAX, help_text="Telegram chat id.")
    ordered = serializers.BooleanField(
        required=False,
        allow_null=True,
        default=None,
        help_text="Wait for earlier messages to the same chat (false: independent notification). "
        "Default: true, except for sendChatAction and answerCallbackQuery, which are not messages.",
    )


class BroadcastCreateSerializer(_SendOptions):
    chat_ids = serializers.ListField(
        child=serializers.IntegerField(min_value=INT64_MIN, max_value=INT64_MAX),
        min_length=1,
        max_length=MAX_BROADCAST_CHATS,
        help_text=f"1 to {MAX_BROADCAST_CHATS:,} chat ids; one message each.",
    )


class AttemptSerializer(serializers.ModelSerializer):
    class Meta:
        model = Attempt
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


class _ClientKeys:
    """`idempotency_key` and `broadcast` as the requesting client (context "client", its
    user id) sent them: without the prefix the outbox keeps clients' keys apart with."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        data = super().to_representation(instance)  # type: ignore[misc]
        client = self.context.get("client")  # type: ignore[attr-defined]
        if client is not None:
            for name in ("idempotency_key", "broadcast"):
                if data.get(name):
                    data[name] = services.client_key_shown(data[name], client=client)
        return data


class MessageSummarySerializer(_ClientKeys, serializers.ModelSerializer):
    """A message in the list: its fields without the attempts' rows and the parts."""

    bot = serializers.CharField(source="bot.name")
    attempts = serializers.IntegerField(help_text="How many attempts were made (of max_attempts).")
    idempotency_key = serializers.CharField(
        help_text="The Idempotency-Key you sent (a broadcast's message: bc:<key>:<chat_id>); "
        "messages that consumers or other clients wrote show their own key."
    )
    trace_id = serializers.CharField(
        help_text="Follows the message through logs, attempts and dead letters: its update's, or its own "
        "(one per API request)."
    )

    class Meta:
        model = OutboundMessage
        fields = [
            "id",
            "bot",
            "chat_id",
            "method",
            "payload",
            "idempotency_key",
            "state",
            "attempts",
            "max_attempts",
            "last_error",
            "last_error_class",
            "cancel_reason",
            "telegram_message_id",
            "send_at",
            "expires_at",
            "next_attempt_at",
            "on_ambiguous",
            "ordered",
            "broadcast",
            "trace_id",
            "created_at",
            "sent_at",
            "updated_at",
            "payload_purged_at",
        ]
        read_only_fields = fields


class MessageSerializer(MessageSummarySerializer):
    attempts_list = AttemptSerializer(
        source="attempt_set",
        many=True,
        read_only=True,
        help_text="Each attempt: its outcome (the error class), HTTP status, Telegram's code and description.",
    )
    parts = serializers.SerializerMethodField(
        help_text="Ids of the messages this request became, in send order: a text longer than Telegram "
        "allows is split into several, and this message is the first; otherwise just this id."
    )

    class Meta(MessageSummarySerializer.Meta):
        fields = [*MessageSummarySerializer.Meta.fields, "attempts_list", "parts"]
        read_only_fields = fields

    @extend_schema_field(serializers.ListField(child=serializers.IntegerField()))
    def get_parts(self, message: OutboundMessage) -> list[int]:
        return selectors.outbound_message_part_ids(message)


class MessageListQuerySerializer(serializers.Serializer):
    """GET /api/v1/messages/'s filters; `cursor` is the paginator's."""

    bot = serializers.CharField(required=False, help_text="Only this bot's messages (its name).")
    state = serializers.ListField(
        child=serializers.ChoiceField(choices=State.values),
        required=False,
        help_text="Only messages in these states: repeat the parameter or separate them by commas.",
    )
    chat_id = serializers.IntegerField(
        required=False, min_value=INT64_MIN, max_value=INT64_MAX, help_text="Only messages to this chat."
    )
    limit = serializers.IntegerField(
        required=False, min_value=1, max_value=MAX_LIST_PAGE, help_text=f"Messages per page (1-{MAX_LIST_PAGE})."
    )

    def validate_bot(self, name: str) -> Any:
        if not 1 <= len(name) <= 64:
            raise serializers.ValidationError("a bot name is a string of 1-64 characters")
        bot = bot_named(name)
        if bot is None:
            raise serializers.ValidationError(f"unknown bot {name!r}")
        return bot


class BroadcastResultSerializer(serializers.Serializer):
    broadcast = serializers.CharField(help_text="The broadcast's Idempotency-Key, as you sent it.")
    bot = serializers.CharField()
    count = serializers.IntegerField(help_text="Messages in the broadcast (one per distinct chat).")
    created = serializers.IntegerField(help_text="Messages created by this request.")
    message_ids = serializers.ListField(child=serializers.IntegerField())


class CancelSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, default="cancelled through the API", max_length=2000)


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()
