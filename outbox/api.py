"""The REST API (docs/API.md): thin views over the outbox services.

POST /api/v1/messages/ and /api/v1/broadcasts/ require an Idempotency-Key header: 201 new,
200 replay of the first answer, 422 same key with another body, 409 while the first request
is still in progress, 400 missing or invalid key. A bot the client may not use is 403 before
any of that, replays included, and a replay's payload is masked as the client may read it now.
GET /api/v1/messages/ lists the messages of the client's bots, newest first, a cursor page at
a time. Keys read back as the client sent them (services.client_key_shown).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import parsers, serializers, status
from rest_framework.exceptions import NotFound, ParseError, ValidationError
from rest_framework.pagination import Cursor, CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core import masking
from core.ids import int64_or_none
from core.payloads import MAX_JSON_DEPTH, json_depth
from outbox import idempotency, selectors, services
from outbox.models import OutboundMessage
from outbox.serializers import (
    MAX_LIST_PAGE,
    BroadcastCreateSerializer,
    BroadcastResultSerializer,
    CancelSerializer,
    ErrorSerializer,
    MessageCreateSerializer,
    MessageListQuerySerializer,
    MessageSerializer,
    MessageSummarySerializer,
    bot_named,
)

IDEMPOTENCY_HEADER = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=True,
    description="1-255 characters, no control characters, unique per request intent; kept at least 24 hours.",
)
IDEMPOTENCY_RESPONSES = {
    400: OpenApiResponse(description="Missing or invalid Idempotency-Key, or invalid body (field errors)."),
    409: OpenApiResponse(ErrorSerializer, description="The first request with this key is still in progress."),
    422: OpenApiResponse(ErrorSerializer, description="This key was used with a different body."),
}


class JSONParser(parsers.JSONParser):
    """DRF's, refusing (400) a body nested deeper than MAX_JSON_DEPTH, as the webhook does."""

    too_deep = f"JSON parse error - the body is nested deeper than {MAX_JSON_DEPTH} levels"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            # json's decoder gives up around a thousand levels.
            raise ParseError(self.too_deep) from None
        if json_depth(data, stop_above=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ParseError(self.too_deep)
        return data


class _View(APIView):
    parser_classes = [JSONParser, parsers.FormParser, parsers.MultiPartParser]


def _idempotent(request: Request, endpoint: str, handle: Callable[[str], Response]) -> Response:
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return Response({"detail": "the Idempotency-Key header is required"}, status=status.HTTP_400_BAD_REQUEST)
    problem = services.idempotency_key_problem(key)
    if problem:
        return Response({"detail": f"invalid Idempotency-Key: {problem}"}, status=status.HTTP_400_BAD_REQUEST)
    # Scope first: a replay too is answered only to a client that may (still) use the bot.
    forbidden = _forbidden_bot(request, bot_named(request.data.get("bot")) if isinstance(request.data, dict) else None)
    if forbidden is not None:
        return forbidden
    begun = idempotency.idempotency_begin(
        scope=f"user:{request.user.pk}:{endpoint}",
        key=key,
        fingerprint=idempotency.request_fingerprint(request.data),
        user=request.user,
    )
    if begun.outcome == "mismatch":
        return _key_reused()
    if begun.outcome == "in_progress":
        return Response(
            {"detail": "a request with this Idempotency-Key is still in progress; retry later"},
            status=status.HTTP_409_CONFLICT,
        )
    if begun.outcome == "replay":
        body = _as_seen_by(request, begun.record.response_body)
        return Response(body, status=status.HTTP_200_OK, headers={"Idempotent-Replayed": "true"})
    try:
        response = handle(key)
    except BaseException:
        idempotency.idempotency_abandon(begun.record)
        raise
    if status.is_success(response.status_code):
        idempotency.idempotency_complete(begun.record, status=response.status_code, body=response.data)
    else:
        idempotency.idempotency_abandon(begun.record)
    return response


def _key_reused() -> Response:
    return Response(
        {"detail": "this Idempotency-Key was used with a different request body"},
        status=status.HTTP_422_UNPROCESSABLE_ENTITY,
    )


def _rejected(exc: services.MessageRejected) -> Response:
    return Response({exc.field: [str(exc)]}, status=status.HTTP_400_BAD_REQUEST)


def _forbidden_bot(request: Request, bot: Any) -> Response | None:
    """403 when `bot` is one this client may not use; None for no bot (the body's to refuse)."""
    if bot is None:
        return None
    allowed = selectors.api_client_bot_ids(request.user)
    if allowed is None or bot.pk in allowed:
        return None
    return Response({"bot": [f"this client may not use bot {bot.name!r}"]}, status=status.HTTP_403_FORBIDDEN)


def _visible(request: Request) -> Any:
    """The messages this client may see: those of the bots it may use."""
    allowed = selectors.api_client_bot_ids(request.user)
    return OutboundMessage.objects.all() if allowed is None else OutboundMessage.objects.filter(bot_id__in=allowed)


def _client(request: Request) -> dict[str, str]:
    """The serializers' context: whose keys to show as they were sent."""
    return {"client": str(request.user.pk)}


def _message_body(message_id: int, request: Request) -> dict[str, Any]:
    message = OutboundMessage.objects.select_related("bot").prefetch_related("attempt_set").get(pk=message_id)
    return _as_seen_by(request, MessageSerializer(message, context=_client(request)).data)


class MessagePages(CursorPagination):
    """Newest first, a page at a time; the `next` link stays right while messages are added.
    A cursor that is not one of ours is a 400 naming it (DRF's answer would be a 404, or a
    500 for a position that is not a number)."""

    ordering = "-id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = MAX_LIST_PAGE
    bad_cursor = "invalid cursor: pass on the `next` or `previous` link as it came"

    def decode_cursor(self, request: Request) -> Cursor | None:
        try:
            cursor = super().decode_cursor(request)
        except NotFound:
            raise ValidationError({"cursor": [self.bad_cursor]}) from None
        if cursor is not None and cursor.position is not None and int64_or_none(str(cursor.position)) is None:
            raise ValidationError({"cursor": [self.bad_cursor]})
        return cursor


def _list_query(request: Request) -> dict[str, Any]:
    """The list's filters from the query string, checked (a 400 names each bad one)."""
    query = request.query_params
    data: dict[str, Any] = {name: query[name] for name in ("bot", "chat_id", "limit") if name in query}
    if "state" in query:
        data["state"] = [s.strip() for value in query.getlist("state") for s in value.split(",") if s.strip()]
    checked = MessageListQuerySerializer(data=data)
    checked.is_valid(raise_exception=True)
    return checked.validated_data


class MessagePageSerializer(serializers.Serializer):
    next = serializers.URLField(allow_null=True, help_text="The next (older) page, or null.")
    previous = serializers.URLField(allow_null=True, help_text="The previous (newer) page, or null.")
    results = MessageSummarySerializer(many=True)


def _as_seen_by(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """An answer holding a message's payload as this client may read it now."""
    if "payload" not in body or selectors.api_client_payload_access(request.user):
        return body
    # The admin's rule: only ids, dates, types, sizes and flags show, at any depth.
    return {**body, "payload": masking.mask(body.get("payload") or {})}


class MessagesView(_View):
    @extend_schema(
        parameters=[
            MessageListQuerySerializer,
            OpenApiParameter("cursor", OpenApiTypes.STR, description="From a page's next or previous link."),
        ],
        responses={200: MessagePageSerializer, 400: OpenApiResponse(description="A bad filter, named."), 403: None},
        summary="The messages of the client's bots, newest first, a page at a time",
        operation_id="v1_messages_list",
    )
    def get(self, request: Request) -> Response:
        query = _list_query(request)
        messages = _visible(request).select_related("bot")
        bot = query.get("bot")
        if bot is not None:
            forbidden = _forbidden_bot(request, bot)
            if forbidden is not None:
                return forbidden
            messages = messages.filter(bot=bot)
        if query.get("state"):
            messages = messages.filter(state__in=query["state"])
        if "chat_id" in query:
            messages = messages.filter(chat_id=query["chat_id"])
        pages = MessagePages()
        page = pages.paginate_queryset(messages, request, view=self)
        rows = MessageSummarySerializer(page, many=True, context=_client(request)).data
        return pages.get_paginated_response([_as_seen_by(request, row) for row in rows])

    @extend_schema(
        request=MessageCreateSerializer,
        parameters=[IDEMPOTENCY_HEADER],
        responses={201: MessageSerializer, 200: MessageSerializer, **IDEMPOTENCY_RESPONSES},
        summary="Queue one Bot API call in the outbox",
    )
    def post(self, request: Request) -> Response:
        def handle(key: str) -> Response:
            serializer = MessageCreateSerializer(data=request.data)
            if not serializer.is_valid():
                return Response(serializer.errors, status=status.HTTP_400_BAD_REQUEST)
            data = serializer.validated_data
            try:
                with transaction.atomic():
                    message, created = services.outbound_message_enqueue(
                        bot_id=data["bot"].pk,
                        chat_id=data["chat_id"],
                        method=data["method"],
                        payload=data["payload"],
                        idempotency_key=services.client_key(client=str(request.user.pk), key=key),
                        send_at=data.get("send_at"),
                        expires_at=data.get("expires_at"),
                        on_ambiguous=data["on_ambiguous"],
                        ordered=data["ordered"],
                    )
            except services.MessageRejected as exc:
                return _rejected(exc)
            except services.IdempotencyConflict:
                # The key's request record was purged, its message was not: same answer as above.
                return _key_reused()
            return Response(_message_body(message.pk, request), status=status.HTTP_201_CREATED if created else 200)

        return _idempotent(request, "messages", handle)


class MessageDetailView(_View):
    @extend_schema(responses={200: MessageSerializer, 404: ErrorSerializer}, summary="A message and its attempts")
    def get(self, request: Request, pk: int) -> Response:
        get_object_or_404(_visible(request).only("pk"), pk=pk)
        return Response(_message_body(pk, request))


class MessageCancelView(_View):
    @extend_schema(
        request=CancelSerializer,
        responses={200: MessageSerializer, 404: ErrorSerializer, 409: ErrorSerializer},
        summary="Cancel a message that has not gone out",
    )
    def post(self, request: Request, pk: int) -> Response:
        message = get_object_or_404(_visible(request).only("pk", "state"), pk=pk)
        serializer = CancelSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        if not services.outbound_message_cancel(pk, reason=serializer.validated_data["reason"]):
            message.refresh_from_db(fields=["state"])
            return Response(
                {
                    "detail": f"message is {message.state}; only pending or retry messages can be cancelled",
                    "state": message.state,
                },
                status=status.HTTP_409_CONFLICT,
            )
        return Response(_message_body(pk, request))


class BroadcastCreateView(_View):
    @extend_schema(
        request=BroadcastCreateSerializer,
        parameters=[IDEMPOTENCY_HEADER],
        responses={201: BroadcastResultSerializer, 200: BroadcastResultSerializer, **IDEMPOTENCY_RESPONSES},
        summary="One payload to many chats, drained within the bot's rate limits",
    )
    def post(self, request: Request) -> Response:
        def handle(key: str) -> Response:
            serializer = BroadcastCreateSerializer(data=request.data)
            if not serializer.is_valid():
                return Response(serializer.errors, status=status.HTTP_400_BAD_REQUEST)
            data = serializer.validated_data
            broadcast_key = services.client_key(client=str(request.user.pk), key=key)
            try:
                result = services.broadcast_enqueue(
                    bot_id=data["bot"].pk,
                    chat_ids=data["chat_ids"],
                    method=data["method"],
                    payload=data["payload"],
                    broadcast_key=broadcast_key,
                    send_at=data.get("send_at"),
                    expires_at=data.get("expires_at"),
                    on_ambiguous=data["on_ambiguous"],
                )
            except services.MessageRejected as exc:
                return _rejected(exc)
            except services.IdempotencyConflict:
                return _key_reused()
            body = {
                "broadcast": key,
                "bot": data["bot"].name,
                "count": len(result.message_ids),
                "created": result.created,
                "message_ids": result.message_ids,
            }
            return Response(body, status=status.HTTP_201_CREATED if result.created else status.HTTP_200_OK)

        return _idempotent(request, "broadcasts", handle)
