"""Responders write auto-replies. `echo` is for the demo and tests; `openai` calls any
OpenAI-compatible chat-completions endpoint.

A responder gets a `Conversation` - the bot, the chat and the gathered messages to answer
- and returns the reply text. It raises the consumer error classes: `TransientError`
(retry later), `PermanentError` (dead letter), `AuthError` (pause auto-reply).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from django.conf import settings

from bots.models import Bot, InboundUpdate
from bots.registry import AuthError, PermanentError, TransientError

logger = logging.getLogger(__name__)

HISTORY_LIMIT = 20


@dataclass
class Conversation:
    """What to answer: the gathered texts of one chat, newest last."""

    bot: Bot
    chat_id: int | None
    texts: Sequence[str]
    upto_message_id: int | None = None
    trace_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def history(self, limit: int = HISTORY_LIMIT) -> list[dict[str, str]]:
        """The chat's recent turns as chat-completions messages, oldest first: the user's
        messages (stored updates, up to the ones being answered) and our sent replies."""
        if self.chat_id is None:
            return [{"role": "user", "content": text} for text in self.texts]
        from outbox.models import OutboundMessage, State

        updates = InboundUpdate.objects.filter(bot=self.bot, chat_id=self.chat_id, update_type="message")
        if self.upto_message_id is not None:
            updates = updates.filter(message_id__lte=self.upto_message_id)
        turns: list[tuple[datetime, str, str]] = [
            (update.received_at, "user", update.text)
            for update in updates.order_by("-received_at")[:limit]
            if update.text
        ]
        sent = (
            OutboundMessage.objects.filter(bot=self.bot, chat_id=self.chat_id, method="sendMessage", state=State.SENT)
            .exclude(payload_purged_at__isnull=False)
            .order_by("-sent_at")
            .only("payload", "sent_at")[:limit]
        )
        turns += [
            (message.sent_at, "assistant", str(message.payload.get("text", "")))
            for message in sent
            if message.sent_at and message.payload.get("text")
        ]
        turns.sort(key=lambda turn: turn[0])
        return [{"role": role, "content": content} for _, role, content in turns[-limit:]]


Responder = Callable[[Conversation], str]


def echo(conversation: Conversation) -> str:
    """`Echo: ` followed by the gathered texts, one per line."""
    return "Echo: " + "\n".join(conversation.texts)


def openai(conversation: Conversation) -> str:
    """Ask an OpenAI-compatible chat-completions endpoint, with the chat's recent messages
    as context. Runs in a worker, never in the webhook: a slow model holds nobody up. A
    worker's event loop uses `openai_async` instead (many calls in flight per process)."""
    url, body, headers = openai_request(conversation)
    try:
        response = httpx.post(url, json=body, headers=headers, timeout=settings.DOVECOTE_OPENAI_TIMEOUT)
    except httpx.TransportError as exc:  # timeouts, refused connections, resets
        raise TransientError(f"model endpoint unreachable: {type(exc).__name__}: {exc}") from exc
    return openai_answer(response)


async def openai_async(conversation: Conversation) -> str:
    """`openai` on the worker's event loop (bots/aio.py): the chat's history read in a
    database thread, the request made with the process's one `httpx.AsyncClient`."""
    from bots import aio

    url, body, headers = await aio.db(openai_request, conversation)
    try:
        response = await aio.http_client().post(
            url, json=body, headers=headers, timeout=settings.DOVECOTE_OPENAI_TIMEOUT
        )
    except httpx.TransportError as exc:
        raise TransientError(f"model endpoint unreachable: {type(exc).__name__}: {exc}") from exc
    return openai_answer(response)


def openai_request(conversation: Conversation) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The chat-completions request for this conversation: (URL, body, headers)."""
    bot = conversation.bot
    base_url = (settings.OPENAI_BASE_URL or "https://api.openai.com/v1").rstrip("/")
    model = bot.openai_model or settings.DOVECOTE_OPENAI_MODEL
    if not model:
        raise PermanentError("no model: set DOVECOTE_OPENAI_MODEL or the bot's openai_model")
    messages: list[dict[str, str]] = []
    if bot.system_prompt:
        messages.append({"role": "system", "content": bot.system_prompt})
    messages += conversation.history()
    if not messages or messages[-1]["role"] != "user":
        # The gathered texts are not stored yet as text updates (e.g. captions only).
        messages.append({"role": "user", "content": "\n".join(conversation.texts)})
    headers = {"Content-Type": "application/json"}
    if settings.OPENAI_API_KEY:
        headers["Authorization"] = f"Bearer {settings.OPENAI_API_KEY}"
    if conversation.trace_id:
        headers["X-Request-Id"] = conversation.trace_id
    return f"{base_url}/chat/completions", {"model": model, "messages": messages}, headers


def openai_answer(response: httpx.Response) -> str:
    """The model's answer, or the consumer error its response means: 401/403 pause
    auto-reply, 408/429/5xx are retried with backoff, another 4xx is dead-lettered."""
    status = response.status_code
    if status in (401, 403):
        raise AuthError(f"model endpoint refused our credentials ({status})")
    if status == 429 or status >= 500 or status == 408:
        raise TransientError(f"model endpoint answered {status}")
    if status >= 400:
        raise PermanentError(f"model endpoint rejected the request ({status}): {response.text[:500]}")
    try:
        content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise TransientError(f"model endpoint answered without a message: {response.text[:200]}") from exc
    if not isinstance(content, str) or not content.strip():
        raise TransientError("model endpoint answered an empty message")
    # A long answer is not cut here: the outbox splits it into several messages.
    return content.strip()


AsyncResponder = Callable[[Conversation], Awaitable[str]]

_RESPONDERS: dict[str, Responder] = {"echo": echo, "openai": openai}
# Responders that wait on the network, in their awaiting form: auto_reply runs on the
# worker's event loop for a bot whose responder is one of these (bots/aio.py).
_ASYNC_RESPONDERS: dict[str, AsyncResponder] = {"openai": openai_async}


def register(name: str, responder: Responder, *, awaiting: AsyncResponder | None = None) -> None:
    """Add a responder; `awaiting`, its form for the worker's event loop (a network call)."""
    _RESPONDERS[name] = responder
    if awaiting is not None:
        _ASYNC_RESPONDERS[name] = awaiting
    else:
        _ASYNC_RESPONDERS.pop(name, None)


def get_responder(name: str) -> Responder | None:
    return _RESPONDERS.get(name)


def get_async_responder(name: str) -> AsyncResponder | None:
    return _ASYNC_RESPONDERS.get(name)
