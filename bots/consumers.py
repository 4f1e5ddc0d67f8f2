"""Built-in consumers. A developer's own go in any app's consumers.py the same way.

- auto_reply: answers with the bot's responder (echo, openai), coalescing bursts.
- crm_webhook: POSTs each message to DOVECOTE_CRM_WEBHOOK_URL with an Idempotency-Key;
  active only when that setting is set.
- analytics: one AnalyticsEvent row per update.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx
from django.conf import settings
from django.utils.module_loading import import_string

from bots import replies
from bots.models import AnalyticsEvent
from bots.registry import AuthError, ConsumerContext, PermanentError, TransientError, consumer
from core import rows


def answers_at_once(update: Any) -> bool:
    """The echo responder (or none) answers without a network call: inline-safe. A model
    (openai) keeps a task of its own, with its own time limit."""
    return update.bot.responder in ("echo", "none")


@consumer(
    "auto_reply",
    update_types=["message"],
    max_attempts=5,
    inline=answers_at_once,
    batch=replies.auto_reply_batch,
    awaiting=replies.auto_reply_async,
    awaits=replies.awaits_model,
)
def auto_reply(ctx: ConsumerContext) -> str:
    """Answer a chat's messages with the bot's responder (see bots/replies.py)."""
    return replies.auto_reply_run(ctx)


def crm_enabled() -> bool:
    # Read at call time: settings can change per deployment and per test.
    return bool(settings.DOVECOTE_CRM_WEBHOOK_URL)


def crm_idempotency_key(ctx: ConsumerContext) -> str:
    """Derived from the update, so every retry (and a replay) sends the same key."""
    return f"dovecote:{ctx.update.bot_id}:{ctx.update.update_id}:crm"


def crm_event(ctx: ConsumerContext) -> dict[str, Any]:
    update = ctx.update
    message = update.payload.get(update.update_type) or {}
    sender = message.get("from") if isinstance(message, dict) else None
    return {
        "event": f"telegram.{update.update_type}",
        "idempotency_key": crm_idempotency_key(ctx),
        "bot": ctx.bot.name,
        "update_id": update.update_id,
        "chat_id": update.chat_id,
        "chat_type": update.chat_type,
        "user_id": update.user_id,
        "message_id": update.message_id,
        "text": update.text,
        "contact": {
            key: sender.get(key) for key in ("first_name", "last_name", "username", "language_code") if key in sender
        }
        if isinstance(sender, dict)
        else {},
        "received_at": update.received_at.isoformat(),
        "trace_id": ctx.trace_id,
    }


def crm_webhook_run(ctx: ConsumerContext) -> str:
    """Send the message to the CRM as a lead/event. Before any retry, ask the lookup hook
    (DOVECOTE_CRM_LOOKUP) whether the CRM already has it: an earlier attempt may have
    created the lead and lost the answer."""
    url = settings.DOVECOTE_CRM_WEBHOOK_URL
    if not url:
        return "crm-disabled"
    if _crm_found(ctx):
        return "found-in-crm"
    try:
        response = httpx.post(url, **_crm_request(ctx))
    except httpx.TransportError as exc:
        raise TransientError(f"CRM unreachable: {type(exc).__name__}: {exc}") from exc
    return crm_outcome(response)


async def crm_webhook_async(ctx: ConsumerContext) -> str:
    """crm_webhook_run awaiting the CRM with the process's HTTP client (bots/aio.py); the
    lookup hook, a synchronous function of the deployment's, in a thread of its own."""
    import asyncio

    from bots import aio

    url = settings.DOVECOTE_CRM_WEBHOOK_URL
    if not url:
        return "crm-disabled"
    if await asyncio.to_thread(_crm_found, ctx):
        return "found-in-crm"
    try:
        response = await aio.http_client().post(url, **_crm_request(ctx))
    except httpx.TransportError as exc:
        raise TransientError(f"CRM unreachable: {type(exc).__name__}: {exc}") from exc
    return crm_outcome(response)


@consumer(
    "crm_webhook",
    update_types=["message"],
    max_attempts=8,
    enabled=crm_enabled,
    awaiting=crm_webhook_async,
)
def crm_webhook(ctx: ConsumerContext) -> str:
    """crm_webhook_run; on a worker's event loop, crm_webhook_async (many CRM calls in
    flight per process)."""
    return crm_webhook_run(ctx)


def _crm_found(ctx: ConsumerContext) -> bool:
    """Whether the lookup hook finds this event in the CRM already (retries only)."""
    if ctx.attempt <= 1 or not settings.DOVECOTE_CRM_LOOKUP:
        return False
    lookup = import_string(settings.DOVECOTE_CRM_LOOKUP)
    try:
        return bool(lookup(crm_idempotency_key(ctx), ctx))
    except httpx.HTTPError as exc:
        raise TransientError(f"CRM lookup failed: {type(exc).__name__}: {exc}") from exc


def _crm_request(ctx: ConsumerContext) -> dict[str, Any]:
    return {
        "json": crm_event(ctx),
        "headers": {"Idempotency-Key": crm_idempotency_key(ctx), "X-Trace-Id": ctx.trace_id},
        "timeout": settings.DOVECOTE_CRM_TIMEOUT,
    }


def crm_outcome(response: httpx.Response) -> str:
    """What the CRM's answer means: 401/403 pause the consumer, 408/409/425/429/5xx are
    retried (409: the CRM is still processing this key), another 4xx is dead-lettered."""
    status = response.status_code
    if status in (401, 403):
        raise AuthError(f"CRM refused our credentials ({status})")
    if status in (408, 409, 425, 429) or status >= 500:
        raise TransientError(f"CRM answered {status}")
    if status >= 400:
        raise PermanentError(f"CRM rejected the event ({status}): {response.text[:500]}")
    return "sent-to-crm"


# latency_ms is a 32-bit column (about 24.8 days). Telegram keeps an undelivered update for 24
# hours, so a longer "latency" is not one (a bad date): stored as unknown.
_MAX_LATENCY_MS = 2**31 - 1


def _timestamp(value: Any) -> datetime | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**37:
        return datetime.fromtimestamp(value, tz=UTC)
    return None


def analytics_event(ctx: ConsumerContext) -> AnalyticsEvent:
    """The update's event row: type, chat, and latency from Telegram's date to receipt
    (whole seconds). An edit is timed from its `edit_date`: its `date` is the original
    message's, which may be months old."""
    update = ctx.update
    body = update.payload.get(update.update_type)
    body = body if isinstance(body, dict) else {}
    message_date = _timestamp(body.get("date"))
    happened_at = _timestamp(body.get("edit_date")) or message_date
    latency_ms = None
    if happened_at is not None:
        latency_ms = max(0, int((update.received_at - happened_at).total_seconds() * 1000))
        if latency_ms > _MAX_LATENCY_MS:
            latency_ms = None
    return rows.new(
        AnalyticsEvent,
        bot_id=update.bot_id,
        update=update,
        update_type=update.update_type,
        chat_id=update.chat_id,
        chat_type=update.chat_type,
        user_id=update.user_id,
        message_date=message_date,
        received_at=update.received_at,
        latency_ms=latency_ms,
    )


def analytics_batch(ctxs: list[ConsumerContext]) -> list[str]:
    """The events of several runs in one statement, committed asynchronously (core/rows.py):
    written before the runs' done mark, it is lost only with that mark, and the runs write it
    again."""
    rows.insert_many_once([analytics_event(ctx) for ctx in ctxs], unique=("update_id",), async_commit=True)
    return ["recorded"] * len(ctxs)


@consumer("analytics", max_attempts=3, inline=True, batch=analytics_batch)
def analytics(ctx: ConsumerContext) -> str:
    """One event row per update (analytics_event), committed asynchronously as in
    `analytics_batch`."""
    rows.insert_once(analytics_event(ctx), unique=("update_id",), async_commit=True)  # a re-run writes nothing new
    return "recorded"
