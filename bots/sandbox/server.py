"""A local, in-memory stand-in for the Telegram Bot API.

The sandbox speaks enough of the Bot API for python-telegram-bot to work against it
(``telegram.Bot(token, base_url=f"{server.base_url}/bot")``), records every call,
keeps the messages it "delivered", and injects faults and flood limits on command
through a small JSON control API under ``/sandbox/``.

Only the standard library is used for serving (plus httpx to push updates to
webhooks), so it starts in milliseconds inside tests and needs no services.
"""

from __future__ import annotations

import argparse
import binascii
import contextlib
import html
import json
import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import httpx

__all__ = [
    "ApiError",
    "Limits",
    "SandboxServer",
    "SandboxState",
    "serve_until_signalled",
]

JSONDict = dict[str, Any]
logger = logging.getLogger(__name__)

MAX_TEXT_LENGTH = 4096
MAX_CAPTION_LENGTH = 1024
MAX_LONG_POLL_SECONDS = 60.0

# Form and multipart posts carry every value as a string (PTB JSON-encodes nested
# values); these names are turned back into the types Telegram would see.
_INT_PARAMS = frozenset(
    {
        "chat_id",
        "from_chat_id",
        "message_id",
        "offset",
        "limit",
        "timeout",
        "reply_to_message_id",
        "message_thread_id",
        "max_connections",
        "user_id",
        "cache_time",
        "update_id",
        "duration",
        "width",
        "height",
    }
)
_BOOL_PARAMS = frozenset(
    {
        "drop_pending_updates",
        "disable_notification",
        "protect_content",
        "show_alert",
        "disable_web_page_preview",
        "allow_sending_without_reply",
        "has_spoiler",
        "disable_content_type_detection",
        "show_caption_above_media",
        "allow_paid_broadcast",
        "remove_caption",
    }
)
_INT_RE = re.compile(r"-?\d+")
_TOKEN_RE = re.compile(r"(\d+):[^/\s]+")
_BOT_PATH_RE = re.compile(r"/bot([^/]*)/([^/]*)/?")
_CONTROL_PREFIX = "/sandbox/"
_MAX_LINE = 65536
_MAX_HEADERS = 100

FAULT_KINDS = frozenset(
    {
        "429",
        "5xx",
        "403",
        "400",
        "401",
        "migrate",
        "slow",
        "drop_after_deliver",
        "drop_before",
    }
)
_FAULT_ERRORS: dict[str, tuple[int, str]] = {
    "403": (403, "Forbidden: bot was blocked by the user"),
    "400": (400, "Bad Request: chat not found"),
    "401": (401, "Unauthorized"),
}
_SERVER_ERROR_TEXT = {
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


class ApiError(Exception):
    """A Bot API error answer: ``{"ok": false, "error_code": ..., "description": ...}``."""

    def __init__(self, status: int, description: str, parameters: JSONDict | None = None) -> None:
        super().__init__(description)
        self.status = status
        self.description = description
        self.parameters = parameters

    def body(self) -> JSONDict:
        body: JSONDict = {
            "ok": False,
            "error_code": self.status,
            "description": self.description,
        }
        if self.parameters:
            body["parameters"] = self.parameters
        return body


class ControlError(Exception):
    """A malformed control-API request (answered as 400 ``{"ok": false, "error": ...}``)."""


@dataclass
class Limits:
    """Flood limits applied to message-creating methods; ``None`` switches one off."""

    per_bot_per_second: int | None = None
    per_private_chat_per_second: int | None = None
    per_group_per_minute: int | None = None


@dataclass
class Fault:
    id: int
    kind: str
    token: str | None = None
    method: str | None = None
    chat_id: int | None = None
    count: int | None = None
    seconds: float | None = None
    retry_after: int = 5
    delay: float = 1.0
    status: int = 502
    migrate_to_chat_id: int | None = None
    created_at: float = 0.0
    expires_at: float | None = None  # monotonic deadline derived from ``seconds``
    remaining: int | None = None  # calls left, derived from ``count``
    hits: int = 0

    def is_live(self, now: float) -> bool:
        if self.remaining is not None and self.remaining <= 0:
            return False
        return self.expires_at is None or now < self.expires_at

    def matches(self, token: str, method: str, chat_id: int | None) -> bool:
        if self.token is not None and self.token != token:
            return False
        if self.method is not None and self.method.lower() != method.lower():
            return False
        return self.chat_id is None or self.chat_id == chat_id

    def public(self) -> JSONDict:
        data = asdict(self)
        del data["expires_at"]
        return data


@dataclass
class Webhook:
    url: str
    secret_token: str | None = None
    allowed_updates: list[str] | None = None
    max_connections: int = 40
    last_error_date: int | None = None
    last_error_message: str | None = None


@dataclass
class StoredMessage:
    token: str
    chat_id: int
    message_id: int
    message: JSONDict
    outgoing: bool  # sent by the bot (vs. pushed as a simulated user's message)
    method: str
    call_id: int | None = None
    deleted: bool = False
    edited: bool = False

    def public(self) -> JSONDict:
        return {
            "token": self.token,
            "chat_id": self.chat_id,
            "message_id": self.message_id,
            "method": self.method,
            "call_id": self.call_id,
            "deleted": self.deleted,
            "edited": self.edited,
            "message": self.message,
        }


@dataclass
class Outcome:
    """What the HTTP layer should do with a bot call: answer, optionally late, or drop."""

    status: int
    body: JSONDict | None  # None: close the connection without answering
    delay: float = 0.0


@dataclass
class _Call:
    """The per-call context handed to method implementations."""

    token: str
    method: str
    params: JSONDict
    chat_id: int | None
    record: JSONDict
    bot: JSONDict = field(default_factory=dict)


MethodImpl = Callable[["SandboxState", _Call], Any]


def _bot_id(token: str) -> int:
    return int(token.split(":", 1)[0])


def _bot_user(token: str) -> JSONDict:
    bot_id = _bot_id(token)
    return {
        "id": bot_id,
        "is_bot": True,
        "first_name": "Sandbox Bot",
        "username": f"{bot_id}_sandbox_bot",
    }


def _chat_ref_to_int(value: Any) -> int | None:
    """Numeric chat id of a parameter value, or None (``@username`` or garbage)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
        return int(value.strip())
    return None


def _username_chat_id(username: str) -> int:
    # Stable fake id for "@channel" targets, shaped like Telegram's -100… channel ids.
    return -(1_000_000_000_000 + zlib.crc32(username.lower().encode()) % 1_000_000_000)


def _chat_object(chat_id: int, chat_type: str | None = None, username: str | None = None) -> JSONDict:
    kind = chat_type or ("private" if chat_id > 0 else "supergroup")
    chat: JSONDict = {"id": chat_id, "type": kind}
    if kind == "private":
        chat["first_name"] = f"User {chat_id}"
    else:
        chat["title"] = f"@{username}" if username else f"Group {chat_id}"
    if username:
        chat["username"] = username
    return chat


def _coerce_param(name: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if name in _INT_PARAMS and _INT_RE.fullmatch(value):
        return int(value)
    if name in _BOOL_PARAMS and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if value and value[0] in "{[":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _file_id(prefix: str) -> tuple[str, str]:
    return prefix + secrets.token_urlsafe(24), secrets.token_urlsafe(8)


def _upload_size(value: Any) -> int:
    return int(value.get("size", 0)) if isinstance(value, dict) else 0


def _is_upload(value: Any) -> bool:
    return isinstance(value, dict) and value.get("_upload") is True


class SandboxState:
    """All sandbox state, guarded by a single lock (calls are tiny, contention is not)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.lock = threading.Lock()
        # Long-polling getUpdates waits on this; pushes and stop() notify it.
        self.updates_arrived = threading.Condition(self.lock)
        self.initial_limits = limits or Limits()
        self.stopping = False
        self._reset_locked()

    # ----------------------------------------------------------------- housekeeping
    def _reset_locked(self) -> None:
        self.calls: list[JSONDict] = []
        self.next_call_id = 1
        self.messages: dict[tuple[str, int, int], StoredMessage] = {}
        self.outgoing: list[StoredMessage] = []
        self.chat_counters: dict[tuple[str, int], int] = {}
        self.faults: list[Fault] = []
        self.next_fault_id = 1
        self.limits = Limits(**asdict(self.initial_limits))
        self.windows: dict[tuple[Any, ...], deque[float]] = {}
        self.webhooks: dict[str, Webhook] = {}
        self.pending: dict[str, list[JSONDict]] = {}
        self.update_counters: dict[str, int] = {}
        self.pushed: list[JSONDict] = []

    def reset(self) -> None:
        with self.lock:
            self._reset_locked()
            self.updates_arrived.notify_all()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.updates_arrived.notify_all()

    # -------------------------------------------------------------------- bot calls
    def bot_call(self, token: str, method_name: str, params: JSONDict, arrived: float) -> Outcome:
        impl_entry = _METHODS.get(method_name.lower())
        method = impl_entry[0] if impl_entry else method_name
        chat_id = _chat_ref_to_int(params.get("chat_id"))
        record: JSONDict = {
            "id": 0,
            "at": arrived,
            "token": token,
            "method": method,
            "params": params,
            "chat_id": chat_id,
            "status": None,
            "delivered": False,
        }
        with self.lock:
            if impl_entry is None or not _TOKEN_RE.fullmatch(token):
                # Telegram answers malformed tokens and unknown methods alike.
                return self._finish(record, ApiError(404, "Not Found"))
            fault = self._match_fault(token, method, chat_id)
            if fault is not None:
                record["fault"] = fault.id
                if fault.kind == "drop_before":
                    record["error"] = {"description": "connection dropped before processing"}
                    self._append(record)
                    return Outcome(0, None)
                error = self._fault_error(fault, chat_id)
                if error is not None:
                    return self._finish(record, error)
            call = _Call(token, method, params, chat_id, record, _bot_user(token))
            try:
                result = impl_entry[1](self, call)
            except ApiError as exc:
                return self._finish(record, exc)
            body: JSONDict = {"ok": True, "result": result}
            if isinstance(result, _Described):
                body = {
                    "ok": True,
                    "result": result.value,
                    "description": result.description,
                }
                result = result.value
            record.update(status=200, delivered=True, result=result)
            if fault is not None and fault.kind == "drop_after_deliver":
                record["status"] = None
                self._append(record)
                return Outcome(0, None)
            self._append(record)
            delay = fault.delay if fault is not None and fault.kind == "slow" else 0.0
            return Outcome(200, body, delay)

    def record_error(self, token: str, method: str, arrived: float, error: ApiError) -> Outcome:
        """Record a call rejected before it could be decoded (e.g. an unparsable body)."""
        entry = _METHODS.get(method.lower())
        record: JSONDict = {
            "id": 0,
            "at": arrived,
            "token": token,
            "method": entry[0] if entry else method,
            "params": {},
            "chat_id": None,
            "status": None,
            "delivered": False,
        }
        with self.lock:
            return self._finish(record, error)

    def _finish(self, record: JSONDict, error: ApiError) -> Outcome:
        body = error.body()
        record.update(status=error.status, error=body)
        self._append(record)
        return Outcome(error.status, body)

    def _append(self, record: JSONDict) -> None:
        record["id"] = self.next_call_id
        self.next_call_id += 1
        self.calls.append(record)

    # ----------------------------------------------------------------------- faults
    def add_fault(self, spec: JSONDict) -> Fault:
        kind = str(spec.get("kind", "")).lower()
        status = _opt_int(spec, "status")
        if kind.isdigit() and len(kind) == 3 and kind.startswith("5"):
            # Accept "502"-style kinds as a convenience for {"kind": "5xx", "status": 502}.
            status, kind = status or int(kind), "5xx"
        if kind not in FAULT_KINDS:
            raise ControlError(f"unknown fault kind {spec.get('kind')!r}; one of {sorted(FAULT_KINDS)}")
        count = _opt_int(spec, "count")
        seconds = _opt_float(spec, "seconds")
        delay = _opt_float(spec, "delay")
        chat_id = spec.get("chat_id")
        if chat_id is not None and _chat_ref_to_int(chat_id) is None:
            raise ControlError("chat_id must be an integer")
        now = time.monotonic()
        with self.lock:
            fault = Fault(
                id=self.next_fault_id,
                kind=kind,
                token=spec.get("token") or None,
                method=spec.get("method") or None,
                chat_id=_chat_ref_to_int(chat_id),
                count=count,
                seconds=seconds,
                retry_after=_opt_int(spec, "retry_after") or 5,
                delay=1.0 if delay is None else delay,
                status=status or 502,
                migrate_to_chat_id=_opt_int(spec, "migrate_to_chat_id"),
                created_at=time.time(),
                expires_at=now + seconds if seconds is not None else None,
                remaining=count,
            )
            self.next_fault_id += 1
            self.faults.append(fault)
            return fault

    def list_faults(self) -> list[JSONDict]:
        now = time.monotonic()
        with self.lock:
            return [f.public() | {"active": f.is_live(now)} for f in self.faults]

    def clear_faults(self, fault_id: int | None = None) -> int:
        with self.lock:
            before = len(self.faults)
            self.faults = [f for f in self.faults if fault_id is not None and f.id != fault_id]
            return before - len(self.faults)

    def _match_fault(self, token: str, method: str, chat_id: int | None) -> Fault | None:
        if not self.faults:
            return None
        now = time.monotonic()
        self.faults = [f for f in self.faults if f.is_live(now)]
        for fault in self.faults:  # creation order: the first live match wins
            if fault.matches(token, method, chat_id):
                fault.hits += 1
                if fault.remaining is not None:
                    fault.remaining -= 1
                return fault
        return None

    @staticmethod
    def _fault_error(fault: Fault, chat_id: int | None) -> ApiError | None:
        if fault.kind == "429":
            ra = max(1, fault.retry_after)
            return ApiError(429, f"Too Many Requests: retry after {ra}", {"retry_after": ra})
        if fault.kind == "5xx":
            text = _SERVER_ERROR_TEXT.get(fault.status) or _status_phrase(fault.status)
            return ApiError(fault.status, text)
        if fault.kind in _FAULT_ERRORS:
            status, text = _FAULT_ERRORS[fault.kind]
            return ApiError(status, text)
        if fault.kind == "migrate":
            new_id = fault.migrate_to_chat_id
            if new_id is None:
                new_id = -(1_000_000_000_000 + abs(chat_id or 1234567890))
            return ApiError(
                400,
                "Bad Request: group chat was upgraded to a supergroup chat",
                {"migrate_to_chat_id": new_id},
            )
        return None  # slow / drop_after_deliver act after the call is performed

    # ----------------------------------------------------------------- flood limits
    def set_limits(self, limits: Limits) -> None:
        with self.lock:
            self.limits = limits

    def _admit(self, token: str, chat_id: int) -> None:
        """Take a flood-limit slot for a message-creating call or raise a real 429."""
        lim = self.limits
        checks: list[tuple[tuple[Any, ...], int, float]] = []
        if lim.per_bot_per_second:
            checks.append((("bot", token), lim.per_bot_per_second, 1.0))
        if chat_id > 0 and lim.per_private_chat_per_second:
            checks.append((("chat", token, chat_id), lim.per_private_chat_per_second, 1.0))
        elif chat_id < 0 and lim.per_group_per_minute:
            checks.append((("group", token, chat_id), lim.per_group_per_minute, 60.0))
        if not checks:
            return
        now = time.monotonic()
        wait = 0.0
        windows = []
        for key, allowed, span in checks:
            window = self.windows.setdefault(key, deque())
            while window and window[0] <= now - span:
                window.popleft()
            if len(window) >= allowed:
                wait = max(wait, window[0] + span - now)
            windows.append(window)
        if wait > 0:
            retry_after = max(1, math.ceil(wait))
            raise ApiError(
                429,
                f"Too Many Requests: retry after {retry_after}",
                {"retry_after": retry_after},
            )
        for window in windows:
            window.append(now)

    # --------------------------------------------------------------------- messages
    def _next_message_id(self, token: str, chat_id: int) -> int:
        key = (token, chat_id)
        value = self.chat_counters.get(key, 0) + 1
        self.chat_counters[key] = value
        return value

    def _target_chat(self, call: _Call, param: str = "chat_id") -> JSONDict:
        raw = call.params.get(param)
        if raw is None or raw == "":
            raise ApiError(400, f"Bad Request: {param} is empty")
        chat_id = _chat_ref_to_int(raw)
        if chat_id is not None and chat_id != 0:
            return _chat_object(chat_id)
        if isinstance(raw, str) and raw.startswith("@") and len(raw) > 1:
            return _chat_object(_username_chat_id(raw[1:]), "channel", raw[1:])
        raise ApiError(400, "Bad Request: chat not found")

    def _create_message(self, call: _Call, chat: JSONDict, content: JSONDict) -> JSONDict:
        self._admit(call.token, chat["id"])
        message_id = self._next_message_id(call.token, chat["id"])
        message: JSONDict = {
            "message_id": message_id,
            "from": call.bot,
            "chat": chat,
            "date": int(time.time()),
        }
        reply_to = self._reply_target(call, chat["id"])
        if reply_to is not None:
            message["reply_to_message"] = reply_to
        thread_id = call.params.get("message_thread_id")
        if isinstance(thread_id, int):
            message["message_thread_id"] = thread_id
        message.update(content)
        markup = call.params.get("reply_markup")
        # Telegram echoes only inline keyboards back in the sent message.
        if isinstance(markup, dict) and "inline_keyboard" in markup:
            message["reply_markup"] = markup
        stored = StoredMessage(call.token, chat["id"], message_id, message, True, call.method, None)
        self.messages[(call.token, chat["id"], message_id)] = stored
        self.outgoing.append(stored)
        call.record["message_id"] = message_id
        return dict(message)  # snapshot: later edits must not rewrite the call record

    def _reply_target(self, call: _Call, chat_id: int) -> JSONDict | None:
        reply_id = call.params.get("reply_to_message_id")
        reply_parameters = call.params.get("reply_parameters")
        if isinstance(reply_parameters, dict):
            reply_id = reply_parameters.get("message_id")
        if not isinstance(reply_id, int):
            return None
        stored = self.messages.get((call.token, chat_id, reply_id))
        if stored is None or stored.deleted:
            return None
        return {k: v for k, v in stored.message.items() if k != "reply_to_message"}

    def _find_message(self, call: _Call, description: str) -> StoredMessage:
        chat = self._target_chat(call)
        message_id = call.params.get("message_id")
        if not isinstance(message_id, int):
            raise ApiError(400, "Bad Request: message identifier is not specified")
        stored = self.messages.get((call.token, chat["id"], message_id))
        if stored is None or stored.deleted:
            raise ApiError(400, f"Bad Request: {description}")
        return stored

    def list_messages(self, token: str | None, chat_id: int | None, include_deleted: bool) -> list[JSONDict]:
        with self.lock:
            return [
                m.public()
                for m in self.outgoing
                if (token is None or m.token == token)
                and (chat_id is None or m.chat_id == chat_id)
                and (include_deleted or not m.deleted)
            ]

    # ---------------------------------------------------------------------- updates
    def _next_update_id(self, token: str) -> int:
        value = self.update_counters.get(token, 0) + 1
        self.update_counters[token] = value
        return value

    def build_update(self, spec: JSONDict) -> tuple[str, JSONDict, Webhook | None]:
        """Turn a control-API push into a Telegram Update; queue it unless a webhook is set."""
        token = spec.get("token")
        if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
            raise ControlError("token must look like '<digits>:<secret>'")
        with self.lock:
            raw = spec.get("update")
            update = dict(raw) if isinstance(raw, dict) else self._user_update(token, spec)
            if isinstance(update.get("update_id"), int):
                # Explicit ids (e.g. a redelivery) must not be reissued by the counter later.
                self.update_counters[token] = max(self.update_counters.get(token, 0), update["update_id"])
            else:
                update = {"update_id": self._next_update_id(token), **update}
            webhook = self.webhooks.get(token)
            entry: JSONDict = {"token": token, "at": time.time(), "update": update}
            self.pushed.append(entry)
            if webhook is None:
                self.pending.setdefault(token, []).append(update)
                entry["queued"] = True
                self.updates_arrived.notify_all()
            return token, update, webhook

    def _user_update(self, token: str, spec: JSONDict) -> JSONDict:
        chat_id = _chat_ref_to_int(spec.get("chat_id"))
        if chat_id is None or chat_id == 0:
            raise ControlError("chat_id (non-zero integer) is required")
        user_id = _chat_ref_to_int(spec.get("user_id")) or abs(chat_id)
        user: JSONDict = {
            "id": user_id,
            "is_bot": False,
            "first_name": spec.get("first_name") or f"User {user_id}",
            "language_code": spec.get("language_code") or "en",
        }
        for key in ("last_name", "username"):
            if spec.get(key):
                user[key] = spec[key]
        chat = _chat_object(chat_id, spec.get("chat_type"))
        if chat["type"] == "private":
            chat["first_name"] = user["first_name"]
            if "username" in user:
                chat["username"] = user["username"]
        if "callback_data" in spec:
            return {"callback_query": self._callback_query(token, spec, user, chat)}
        text = spec.get("text")
        if not isinstance(text, str) or not text:
            raise ControlError("text (non-empty string) is required")
        message_id = _chat_ref_to_int(spec.get("message_id"))
        if message_id is None:
            message_id = self._next_message_id(token, chat_id)
        else:
            self.chat_counters[(token, chat_id)] = max(self.chat_counters.get((token, chat_id), 0), message_id)
        message: JSONDict = {
            "message_id": message_id,
            "from": user,
            "chat": chat,
            "date": int(time.time()),
            "text": text,
        }
        if text.startswith("/"):
            # PTB's CommandHandler only fires on a bot_command entity at offset 0.
            command = text.split(maxsplit=1)[0]
            message["entities"] = [{"type": "bot_command", "offset": 0, "length": len(command)}]
        self.messages[(token, chat_id, message_id)] = StoredMessage(token, chat_id, message_id, message, False, "push")
        return {"message": message}

    def _callback_query(self, token: str, spec: JSONDict, user: JSONDict, chat: JSONDict) -> JSONDict:
        query: JSONDict = {
            "id": str(secrets.randbits(63)),
            "from": user,
            "chat_instance": str(zlib.crc32(f"{token}:{chat['id']}".encode())),
            "data": str(spec["callback_data"]),
        }
        message_id = _chat_ref_to_int(spec.get("message_id"))
        if message_id is not None:
            stored = self.messages.get((token, chat["id"], message_id))
            query["message"] = (
                dict(stored.message)
                if stored is not None
                else {"message_id": message_id, "date": int(time.time()), "chat": chat}
            )
        return query

    def note_webhook_result(self, token: str, update: JSONDict, status: int | None, error: str | None) -> None:
        with self.lock:
            for entry in reversed(self.pushed):
                if entry["update"] is update:
                    entry.update(webhook_status=status, webhook_error=error)
                    break
            webhook = self.webhooks.get(token)
            if webhook is not None and error is not None:
                webhook.last_error_date = int(time.time())
                webhook.last_error_message = error

    def list_pushed(self, token: str | None) -> list[JSONDict]:
        with self.lock:
            return [dict(e) for e in self.pushed if token is None or e["token"] == token]

    # -------------------------------------------------------------------- inspection
    def list_calls(
        self,
        token: str | None = None,
        method: str | None = None,
        chat_id: int | None = None,
        delivered: bool | None = None,
        after: int | None = None,
    ) -> list[JSONDict]:
        method_l = method.lower() if method else None
        with self.lock:
            snapshot = list(self.calls)
        return [
            c
            for c in snapshot
            if (token is None or c["token"] == token)
            and (method_l is None or c["method"].lower() == method_l)
            and (chat_id is None or c["chat_id"] == chat_id)
            and (delivered is None or c["delivered"] is delivered)
            and (after is None or c["id"] > after)
        ]


class _Described:
    """A result that Telegram answers together with a top-level ``description``."""

    def __init__(self, value: Any, description: str) -> None:
        self.value = value
        self.description = description


def _status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _opt_int(spec: JSONDict, key: str) -> int | None:
    value = spec.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ControlError(f"{key} must be an integer") from None


def _opt_float(spec: JSONDict, key: str) -> float | None:
    value = spec.get(key)
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ControlError(f"{key} must be a number") from None


# ============================================================================ methods
def _get_me(state: SandboxState, call: _Call) -> JSONDict:
    return call.bot | {
        "can_join_groups": True,
        "can_read_all_group_messages": False,
        "supports_inline_queries": False,
        "can_connect_to_business": False,
        "has_main_web_app": False,
    }


_HTML_TAG = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9-]*)(?:\s(?:[^<>\"']|\"[^\"]*\"|'[^']*')*)?>")
_HTML_REF = re.compile(r"&(?:#[0-9]+|#[xX][0-9A-Fa-f]+|[A-Za-z][A-Za-z0-9]*);")
_MARKDOWN_MARKUP = re.compile(r"\\(.)|```[A-Za-z0-9_+-]*|\]\((?:[^()\\]|\\.)*\)|[*_~|`\[\]]|^>", re.M | re.S)


def _parsed_length(text: str, parse_mode: Any) -> int:
    """Telegram's length of a text: UTF-16 code units after entity parsing (HTML tags and
    Markdown markup do not count; `&amp;` counts as the one character it stands for)."""
    mode = parse_mode.lower() if isinstance(parse_mode, str) else ""
    if mode == "html":
        text = _HTML_REF.sub(lambda m: html.unescape(m.group(0)), _HTML_TAG.sub("", text))
    elif mode in ("markdown", "markdownv2"):
        text = _MARKDOWN_MARKUP.sub(lambda m: m.group(1) or "", text)
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def _checked_text(value: Any, *, caption: bool = False, parse_mode: Any = None) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value)
    limit = MAX_CAPTION_LENGTH if caption else MAX_TEXT_LENGTH
    if _parsed_length(text, parse_mode) > limit:
        raise ApiError(
            400,
            "Bad Request: message caption is too long" if caption else "Bad Request: message is too long",
        )
    return text


def _send_message(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    text = call.params.get("text")
    if text is None or (isinstance(text, str) and not text.strip()):
        raise ApiError(400, "Bad Request: message text is empty")
    content: JSONDict = {"text": _checked_text(text, parse_mode=call.params.get("parse_mode"))}
    entities = call.params.get("entities")
    if isinstance(entities, list):
        content["entities"] = entities
    return state._create_message(call, chat, content)


def _caption(call: _Call) -> JSONDict:
    caption = _checked_text(call.params.get("caption"), caption=True, parse_mode=call.params.get("parse_mode"))
    return {"caption": caption} if caption else {}


def _media_ref(call: _Call, name: str) -> Any:
    value = call.params.get(name)
    if value is None or value == "":
        raise ApiError(400, f"Bad Request: there is no {name} in the request")
    return value


def _send_photo(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    ref = _media_ref(call, "photo")
    reuse = isinstance(ref, str) and not ref.startswith(("http://", "https://"))
    size = _upload_size(ref) or 54_321
    sizes = []
    for width, height, share in ((90, 67, 0.05), (320, 240, 0.3), (800, 600, 1.0)):
        file_id, unique = (ref, ref[-8:]) if reuse else _file_id("AgACAgIAAxkDAAI")
        sizes.append(
            {
                "file_id": file_id,
                "file_unique_id": unique,
                "width": width,
                "height": height,
                "file_size": max(1, int(size * share)),
            }
        )
    return state._create_message(call, chat, {"photo": sizes} | _caption(call))


def _send_document(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    ref = _media_ref(call, "document")
    document: JSONDict
    if _is_upload(ref):
        file_id, unique = _file_id("BQACAgIAAxkDAAI")
        document = {
            "file_id": file_id,
            "file_unique_id": unique,
            "file_name": ref.get("filename") or "document",
            "mime_type": ref.get("content_type") or "application/octet-stream",
            "file_size": _upload_size(ref),
        }
    elif isinstance(ref, str) and ref.startswith(("http://", "https://")):
        file_id, unique = _file_id("BQACAgIAAxkDAAI")
        name = os.path.basename(urlsplit(ref).path) or "document"
        document = {"file_id": file_id, "file_unique_id": unique, "file_name": name}
    else:
        document = {"file_id": str(ref), "file_unique_id": str(ref)[-8:]}
    return state._create_message(call, chat, {"document": document} | _caption(call))


# Other media: (file id prefix as Telegram's, whether it takes a caption).
_FILE_MEDIA = {
    "audio": ("CQACAgIAAxkDAAI", True),
    "video": ("BAACAgIAAxkDAAI", True),
    "voice": ("AwACAgIAAxkDAAI", True),
    "animation": ("CgACAgIAAxkDAAI", True),
    "sticker": ("CAACAgIAAxkDAAI", False),
}


def _send_file(kind: str) -> MethodImpl:
    prefix, captioned = _FILE_MEDIA[kind]

    def send(state: SandboxState, call: _Call) -> JSONDict:
        chat = state._target_chat(call)
        ref = _media_ref(call, kind)
        if _is_upload(ref) or (isinstance(ref, str) and ref.startswith(("http://", "https://"))):
            file_id, unique = _file_id(prefix)
        else:
            file_id, unique = str(ref), str(ref)[-8:]
        media: JSONDict = {"file_id": file_id, "file_unique_id": unique}
        if _upload_size(ref):
            media["file_size"] = _upload_size(ref)
        return state._create_message(call, chat, {kind: media} | (_caption(call) if captioned else {}))

    return send


def _number(call: _Call, name: str) -> float:
    value = call.params.get(name)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"Bad Request: {name} is invalid") from None


def _send_location(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    location = {"latitude": _number(call, "latitude"), "longitude": _number(call, "longitude")}
    if not (-90 <= location["latitude"] <= 90 and -180 <= location["longitude"] <= 180):
        raise ApiError(400, "Bad Request: wrong latitude or longitude")
    return state._create_message(call, chat, {"location": location})


def _send_contact(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    phone, first_name = call.params.get("phone_number"), call.params.get("first_name")
    if not phone or not first_name:
        raise ApiError(400, "Bad Request: phone number and first name are required")
    contact = {"phone_number": str(phone), "first_name": str(first_name)}
    if call.params.get("last_name"):
        contact["last_name"] = str(call.params["last_name"])
    return state._create_message(call, chat, {"contact": contact})


_DICE = {"🎲": 6, "🎯": 6, "🎳": 6, "🏀": 5, "⚽": 5, "🎰": 64}


def _send_dice(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    emoji = call.params.get("emoji") or "🎲"
    if emoji not in _DICE:
        raise ApiError(400, "Bad Request: invalid dice emoji specified")
    return state._create_message(call, chat, {"dice": {"emoji": emoji, "value": secrets.randbelow(_DICE[emoji]) + 1}})


def _send_poll(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    question, options = call.params.get("question"), call.params.get("options")
    if not isinstance(question, str) or not question.strip():
        raise ApiError(400, "Bad Request: poll question must be non-empty")
    if not isinstance(options, list) or not 2 <= len(options) <= 10:
        raise ApiError(400, "Bad Request: poll must have 2-10 options")
    poll = {
        "id": str(secrets.randbits(63)),
        "question": question,
        "options": [{"text": o.get("text", "") if isinstance(o, dict) else str(o), "voter_count": 0} for o in options],
        "total_voter_count": 0,
        "is_closed": False,
        "is_anonymous": call.params.get("is_anonymous", True) is not False,
        "type": call.params.get("type") or "regular",
        "allows_multiple_answers": bool(call.params.get("allows_multiple_answers")),
    }
    return state._create_message(call, chat, {"poll": poll})


def _send_media_group(state: SandboxState, call: _Call) -> list[JSONDict]:
    chat = state._target_chat(call)
    media = call.params.get("media")
    if not isinstance(media, list) or not 2 <= len(media) <= 10:
        raise ApiError(400, "Bad Request: wrong number of messages in the media group (2-10)")
    group_id = str(secrets.randbits(63))
    messages = []
    for item in media:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind not in ("photo", "video", "document", "audio") or not item.get("media"):
            raise ApiError(400, "Bad Request: wrong media in the media group")
        file_id, unique = _file_id(_FILE_MEDIA.get(kind, ("AgACAgIAAxkDAAI", True))[0])
        content: JSONDict = {kind: {"file_id": file_id, "file_unique_id": unique}, "media_group_id": group_id}
        caption = _checked_text(item.get("caption"), caption=True, parse_mode=item.get("parse_mode"))
        if caption:
            content["caption"] = caption
        messages.append(state._create_message(call, chat, content))
    return messages


def _edit_message_caption(state: SandboxState, call: _Call) -> JSONDict | bool:
    caption = _checked_text(call.params.get("caption"), caption=True, parse_mode=call.params.get("parse_mode"))
    if call.params.get("inline_message_id"):
        return True
    stored = state._find_message(call, "message to edit not found")
    if not stored.outgoing:
        raise ApiError(400, "Bad Request: message can't be edited")
    if "text" in stored.message:
        raise ApiError(400, "Bad Request: there is no caption in the message to edit")
    message = dict(stored.message, edit_date=int(time.time()))
    message.pop("caption", None)
    if caption:
        message["caption"] = caption
    stored.message, stored.edited = message, True
    return dict(message)


def _pin_chat_message(state: SandboxState, call: _Call) -> bool:
    state._find_message(call, "message to pin not found")
    return True


def _unpin_chat_message(state: SandboxState, call: _Call) -> bool:
    if call.params.get("message_id") is not None:
        state._find_message(call, "message to unpin not found")
    else:
        state._target_chat(call)
    return True


_CONTENT_KEYS = ("text", "entities", "photo", "document", "caption", "caption_entities")


def _copy_content(state: SandboxState, call: _Call) -> JSONDict:
    source_chat = state._target_chat(call, "from_chat_id")
    message_id = call.params.get("message_id")
    if not isinstance(message_id, int):
        raise ApiError(400, "Bad Request: message identifier is not specified")
    stored = state.messages.get((call.token, source_chat["id"], message_id))
    # Lenient on purpose: sources posted outside the sandbox (e.g. a channel post the
    # project only knows by id) still produce a copy, flagged so tests can tell.
    if stored is None:
        return {"sandbox_source_missing": True}
    return {k: v for k, v in stored.message.items() if k in _CONTENT_KEYS}


def _copy_message(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    content = _copy_content(state, call)
    if "caption" in call.params:
        content.pop("caption", None)
        content |= _caption(call)
    created = state._create_message(call, chat, content)
    return {"message_id": created["message_id"]}


def _forward_message(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    content = _copy_content(state, call)
    content["forward_origin"] = {
        "type": "chat",
        "date": int(time.time()),
        "sender_chat": state._target_chat(call, "from_chat_id"),
    }
    return state._create_message(call, chat, content)


def _edit_message_text(state: SandboxState, call: _Call) -> JSONDict | bool:
    text = call.params.get("text")
    if text is None or (isinstance(text, str) and not text.strip()):
        raise ApiError(400, "Bad Request: message text is empty")
    text = _checked_text(text, parse_mode=call.params.get("parse_mode"))
    if call.params.get("inline_message_id"):
        return True  # inline messages are not stored; Telegram answers True for them
    stored = state._find_message(call, "message to edit not found")
    if not stored.outgoing:
        raise ApiError(400, "Bad Request: message can't be edited")
    markup = call.params.get("reply_markup")
    new_markup = markup if isinstance(markup, dict) and "inline_keyboard" in markup else None
    if stored.message.get("text") == text and stored.message.get("reply_markup") == new_markup:
        raise ApiError(
            400,
            "Bad Request: message is not modified: specified new message content and reply "
            "markup are exactly the same as a current content and reply markup of the message",
        )
    message = dict(stored.message)
    message.update(text=text, edit_date=int(time.time()))
    message.pop("entities", None)
    message.pop("reply_markup", None)
    if new_markup is not None:
        message["reply_markup"] = new_markup
    stored.message, stored.edited = message, True
    return dict(message)


def _edit_message_reply_markup(state: SandboxState, call: _Call) -> JSONDict | bool:
    if call.params.get("inline_message_id"):
        return True
    stored = state._find_message(call, "message to edit not found")
    markup = call.params.get("reply_markup")
    message = dict(stored.message, edit_date=int(time.time()))
    message.pop("reply_markup", None)
    if isinstance(markup, dict) and "inline_keyboard" in markup:
        message["reply_markup"] = markup
    stored.message, stored.edited = message, True
    return dict(message)


def _delete_message(state: SandboxState, call: _Call) -> bool:
    stored = state._find_message(call, "message to delete not found")
    stored.deleted = True
    return True


def _answer_callback_query(state: SandboxState, call: _Call) -> bool:
    if not call.params.get("callback_query_id"):
        raise ApiError(
            400,
            "Bad Request: query is too old and response timeout expired or query ID is invalid",
        )
    return True


def _true(state: SandboxState, call: _Call) -> bool:
    return True


def _chat_action(state: SandboxState, call: _Call) -> bool:
    state._target_chat(call)
    return True


def _get_chat(state: SandboxState, call: _Call) -> JSONDict:
    chat = state._target_chat(call)
    return chat | {
        "accent_color_id": 0,
        "max_reaction_count": 11,
        "accepted_gift_types": {
            "unlimited_gifts": False,
            "limited_gifts": False,
            "unique_gifts": False,
            "premium_subscription": False,
        },
    }


def _get_my_commands(state: SandboxState, call: _Call) -> list[JSONDict]:
    return []


def _set_webhook(state: SandboxState, call: _Call) -> _Described:
    url = call.params.get("url") or ""
    if not isinstance(url, str):
        raise ApiError(400, "Bad Request: bad webhook: invalid URL")
    if call.params.get("drop_pending_updates") is True:
        state.pending.pop(call.token, None)
    if not url:
        existed = state.webhooks.pop(call.token, None) is not None
        return _Described(True, "Webhook was deleted" if existed else "Webhook is already deleted")
    if not url.startswith(("http://", "https://", "/")):
        raise ApiError(400, "Bad Request: bad webhook: An HTTPS URL must be provided for webhook")
    allowed = call.params.get("allowed_updates")
    secret = call.params.get("secret_token")
    existing = state.webhooks.get(call.token)
    state.webhooks[call.token] = Webhook(
        url=url,
        secret_token=str(secret) if secret else None,
        allowed_updates=allowed if isinstance(allowed, list) else (existing.allowed_updates if existing else None),
        max_connections=int(call.params.get("max_connections") or 40),
    )
    # Telegram says "is already set" only when nothing changed; tests do not care.
    return _Described(True, "Webhook was set")


def _delete_webhook(state: SandboxState, call: _Call) -> _Described:
    if call.params.get("drop_pending_updates") is True:
        state.pending.pop(call.token, None)
    existed = state.webhooks.pop(call.token, None) is not None
    return _Described(True, "Webhook was deleted" if existed else "Webhook is already deleted")


def _get_webhook_info(state: SandboxState, call: _Call) -> JSONDict:
    webhook = state.webhooks.get(call.token)
    info: JSONDict = {
        "url": webhook.url if webhook else "",
        "has_custom_certificate": False,
        "pending_update_count": len(state.pending.get(call.token, [])),
    }
    if webhook is not None:
        info["max_connections"] = webhook.max_connections
        info["ip_address"] = "127.0.0.1"
        if webhook.allowed_updates is not None:
            info["allowed_updates"] = webhook.allowed_updates
        if webhook.last_error_date is not None:
            info["last_error_date"] = webhook.last_error_date
            info["last_error_message"] = webhook.last_error_message
    return info


def _update_kind(update: JSONDict) -> str | None:
    return next((k for k in update if k != "update_id"), None)


def _get_updates(state: SandboxState, call: _Call) -> list[JSONDict]:
    if call.token in state.webhooks:
        raise ApiError(
            409,
            "Conflict: can't use getUpdates method while webhook is active; "
            "use deleteWebhook to delete the webhook first",
        )
    params = call.params
    offset = params.get("offset")
    limit = params.get("limit")
    limit = min(max(limit, 1), 100) if isinstance(limit, int) else 100
    timeout = params.get("timeout")
    timeout = min(max(float(timeout), 0.0), MAX_LONG_POLL_SECONDS) if isinstance(timeout, int | float) else 0.0
    allowed = params.get("allowed_updates")
    allowed_set = set(allowed) if isinstance(allowed, list) and allowed else None
    deadline = time.monotonic() + timeout
    while True:
        queue = state.pending.get(call.token, [])
        if isinstance(offset, int) and offset > 0:
            # Asking for offset N confirms every update below N, as Telegram does.
            queue = [u for u in queue if u.get("update_id", 0) >= offset]
        elif isinstance(offset, int) and offset < 0:
            queue = queue[offset:]
        state.pending[call.token] = queue
        ready = [u for u in queue if allowed_set is None or _update_kind(u) in allowed_set]
        remaining = deadline - time.monotonic()
        if ready or remaining <= 0 or state.stopping or call.token in state.webhooks:
            return ready[:limit]
        # Releases the state lock while waiting, so pushes and other calls proceed.
        state.updates_arrived.wait(remaining)


# Lower-cased name -> (canonical name, implementation). Telegram method names are
# case-insensitive, so lookups go through the lower-cased key.
_METHODS: dict[str, tuple[str, MethodImpl]] = {
    name.lower(): (name, impl)
    for name, impl in (
        ("getMe", _get_me),
        ("sendMessage", _send_message),
        ("sendPhoto", _send_photo),
        ("sendDocument", _send_document),
        ("sendAudio", _send_file("audio")),
        ("sendVideo", _send_file("video")),
        ("sendVoice", _send_file("voice")),
        ("sendAnimation", _send_file("animation")),
        ("sendSticker", _send_file("sticker")),
        ("sendLocation", _send_location),
        ("sendContact", _send_contact),
        ("sendDice", _send_dice),
        ("sendPoll", _send_poll),
        ("sendMediaGroup", _send_media_group),
        ("editMessageCaption", _edit_message_caption),
        ("pinChatMessage", _pin_chat_message),
        ("unpinChatMessage", _unpin_chat_message),
        ("copyMessage", _copy_message),
        ("forwardMessage", _forward_message),
        ("editMessageText", _edit_message_text),
        ("editMessageReplyMarkup", _edit_message_reply_markup),
        ("deleteMessage", _delete_message),
        ("answerCallbackQuery", _answer_callback_query),
        ("sendChatAction", _chat_action),
        ("getChat", _get_chat),
        ("setMyCommands", _true),
        ("deleteMyCommands", _true),
        ("getMyCommands", _get_my_commands),
        ("setWebhook", _set_webhook),
        ("deleteWebhook", _delete_webhook),
        ("getWebhookInfo", _get_webhook_info),
        ("getUpdates", _get_updates),
        ("logOut", _true),
        ("close", _true),
    )
}


# ======================================================================= HTTP layer
def _parse_multipart(body: bytes, content_type: str) -> JSONDict:
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if not match:
        raise ValueError("multipart body without boundary")
    delimiter = b"--" + match.group(1).encode("latin-1")
    fields: JSONDict = {}
    files: dict[str, JSONDict] = {}
    for part in body.split(delimiter)[1:]:
        if part.startswith(b"--"):
            break  # closing delimiter
        head, _, content = part.partition(b"\r\n\r\n")
        if content.endswith(b"\r\n"):
            content = content[:-2]
        headers = head.decode("latin-1")
        name = re.search(r'\bname="([^"]*)"', headers)
        if not name:
            continue
        filename = re.search(r'\bfilename="([^"]*)"', headers)
        ctype = re.search(r"(?im)^content-type:\s*([^\r\n;]+)", headers)
        if filename is not None:
            # Record what was uploaded, not the bytes: the call log stays small and JSON-able.
            files[name.group(1)] = {
                "_upload": True,
                "filename": filename.group(1),
                "content_type": ctype.group(1).strip() if ctype else None,
                "size": len(content),
                "crc32": binascii.crc32(content),
            }
        else:
            fields[name.group(1)] = content.decode("utf-8", "replace")
    for key, value in list(fields.items()):
        # InputMedia-style parameters point at parts via attach://<name>.
        if isinstance(value, str) and value.startswith("attach://") and value[9:] in files:
            fields[key] = files.pop(value[9:])
    return {**files, **fields}


def _decode_params(query: str, body: bytes, content_type: str) -> JSONDict:
    params: JSONDict = dict(parse_qsl(query, keep_blank_values=True)) if query else {}
    ctype = content_type.split(";", 1)[0].strip().lower()
    if body:
        if ctype == "application/json" or (not ctype and body[:1] in (b"{", b"[")):
            decoded = json.loads(body)
            if not isinstance(decoded, dict):
                raise ValueError("JSON body must be an object")
            params.update(decoded)
        elif ctype == "multipart/form-data":
            params.update(_parse_multipart(body, content_type))
        else:
            params.update(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
    return {name: _coerce_param(name, value) for name, value in params.items()}


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def _flag(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.lower() in ("1", "true", "yes", "on")


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    # Keep-alive: one TCP connection per client, not per call.
    protocol_version = "HTTP/1.1"
    server_version = "DovecoteBotApiSandbox/1.0"

    def setup(self) -> None:
        super().setup()
        # Responses go out in one write; no Nagle so nothing waits on a delayed ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection, add=True)
        self.fields: dict[str, str] = {}

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # per-request logging would dominate benchmark time

    def handle_one_request(self) -> None:
        """Parse one request without ``email`` (~40% of CPU per call in the stdlib path)."""
        try:
            line = self.rfile.readline(_MAX_LINE + 1)
        except OSError:
            self.close_connection = True
            return
        if not line:
            self.close_connection = True
            return
        self.raw_requestline = line
        self.requestline = line.decode("latin-1").rstrip("\r\n")
        parts = self.requestline.split()
        if len(line) > _MAX_LINE or len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self.close_connection = True
            self._respond(400, {"ok": False, "error_code": 400, "description": "Bad Request"})
            return
        self.command, self.path, self.request_version = parts
        fields: dict[str, str] = {}
        for _ in range(_MAX_HEADERS):
            raw = self.rfile.readline(_MAX_LINE + 1)
            if raw in (b"\r\n", b"\n", b""):
                break
            name, _, value = raw.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
        else:
            self.close_connection = True
            self._respond(431, {"ok": False, "error_code": 431, "description": "Too Many Headers"})
            return
        self.fields = fields
        connection = fields.get("connection", "").lower()
        if self.request_version == "HTTP/1.0":
            self.close_connection = "keep-alive" not in connection
        else:
            self.close_connection = "close" in connection
        if fields.get("expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            self._dispatch()
        except Exception:
            # A sandbox bug must surface as a loud 500, not as a mysterious dropped connection.
            logger.exception("Bot API sandbox failed on %s %s", self.command, self.path)
            self.close_connection = True
            self._respond(500, {"ok": False, "error_code": 500, "description": "Internal Server Error"})

    # ---------------------------------------------------------------- plumbing
    def _read_body(self) -> bytes:
        if "chunked" in self.fields.get("transfer-encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.fields.get("content-length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _respond(self, status: int, payload: Any) -> None:
        body = _json_bytes(payload)
        head = (
            f"HTTP/1.1 {status} {_status_phrase(status)}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if self.close_connection else ''}"
            "\r\n"
        )
        try:
            # Head and body in a single write: one segment per response on keep-alive.
            self.wfile.write(head.encode("latin-1") + body)
        except OSError:
            self.close_connection = True  # the client gave up (e.g. a read timeout)

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _dispatch(self) -> None:
        arrived = time.time()
        split = urlsplit(self.path)
        path = split.path
        try:
            body = self._read_body()
        except (OSError, ValueError):
            self._drop()
            return
        sandbox: SandboxServer = self.server.sandbox
        if path.startswith(_CONTROL_PREFIX):
            self._control(sandbox, path[len(_CONTROL_PREFIX) :].strip("/"), split.query, body)
            return
        match = _BOT_PATH_RE.fullmatch(path)
        if match is None:
            self._respond(404, {"ok": False, "error_code": 404, "description": "Not Found"})
            return
        token, method = unquote(match.group(1)), match.group(2)
        try:
            params = _decode_params(split.query, body, self.fields.get("content-type", ""))
        except (ValueError, UnicodeDecodeError):
            error = ApiError(400, "Bad Request: can't parse request parameters")
            outcome = sandbox.state.record_error(token, method, arrived, error)
        else:
            outcome = sandbox.state.bot_call(token, method, params, arrived)
        if outcome.body is None:
            self._drop()
            return
        if outcome.delay > 0:
            time.sleep(outcome.delay)  # "slow" fault: the call already took effect
        self._respond(outcome.status, outcome.body)

    # ------------------------------------------------------------- control API
    def _control(self, sandbox: SandboxServer, route: str, query: str, body: bytes) -> None:
        verb = self.command
        args = dict(parse_qsl(query))
        state = sandbox.state
        try:
            spec = json.loads(body) if body.strip() else {}
            if not isinstance(spec, dict):
                raise ControlError("JSON object body expected")
            if route == "health":
                self._respond(200, {"ok": True})
            elif route == "calls" and verb == "GET":
                calls = state.list_calls(
                    token=args.get("token") or None,
                    method=args.get("method") or None,
                    chat_id=_chat_ref_to_int(args.get("chat_id")),
                    delivered=_flag(args.get("delivered")),
                    after=_chat_ref_to_int(args.get("after")),
                )
                self._respond(200, {"calls": calls})
            elif route == "messages" and verb == "GET":
                messages = state.list_messages(
                    args.get("token") or None,
                    _chat_ref_to_int(args.get("chat_id")),
                    bool(_flag(args.get("include_deleted"))),
                )
                self._respond(200, {"messages": messages})
            elif route == "reset" and verb == "POST":
                state.reset()
                self._respond(200, {"ok": True})
            elif route == "faults" and verb == "POST":
                fault = state.add_fault(spec)
                self._respond(200, {"ok": True, **fault.public()})
            elif route == "faults" and verb == "GET":
                self._respond(200, {"faults": state.list_faults()})
            elif route == "faults" and verb == "DELETE":
                self._respond(200, {"ok": True, "cleared": state.clear_faults()})
            elif route.startswith("faults/") and verb == "DELETE":
                fault_id = _chat_ref_to_int(route[7:])
                if fault_id is None:
                    raise ControlError("fault id must be an integer")
                self._respond(200, {"ok": True, "cleared": state.clear_faults(fault_id)})
            elif route == "limits" and verb == "POST":
                limits = Limits(
                    per_bot_per_second=_opt_int(spec, "per_bot_per_second"),
                    per_private_chat_per_second=_opt_int(spec, "per_private_chat_per_second"),
                    per_group_per_minute=_opt_int(spec, "per_group_per_minute"),
                )
                state.set_limits(limits)
                self._respond(200, {"ok": True, **asdict(limits)})
            elif route == "limits" and verb == "GET":
                with state.lock:
                    current = asdict(state.limits)
                self._respond(200, current)
            elif route == "updates" and verb == "POST":
                self._respond(200, sandbox.push_update(spec))
            elif route == "updates" and verb == "GET":
                self._respond(200, {"updates": state.list_pushed(args.get("token") or None)})
            else:
                self._respond(
                    404,
                    {"ok": False, "error": f"no control route {verb} /sandbox/{route}"},
                )
        except (ControlError, ValueError) as exc:
            self._respond(400, {"ok": False, "error": str(exc)})


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # long-polls and idle keep-alive connections must not block exit
    block_on_close = False
    request_queue_size = 128  # benchmarks open many connections at once

    def __init__(self, address: tuple[str, int], sandbox: SandboxServer) -> None:
        self.sandbox = sandbox
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def track(self, conn: socket.socket, *, add: bool) -> None:
        with self._connections_lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def close_connections(self) -> None:
        with self._connections_lock:
            conns = list(self._connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class SandboxServer:
    """The Bot API sandbox HTTP server.

    ``webhook_base`` rewrites where webhooks are delivered: a bot registering
    ``https://bot.example.com/tg/hook`` gets its updates POSTed to
    ``<webhook_base>/tg/hook`` (relative webhook URLs are joined to it as well), so
    production-looking URLs reach a local Django runserver.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8081,
        webhook_base: str | None = None,
        *,
        per_bot_per_second: int | None = None,
        per_private_chat_per_second: int | None = None,
        per_group_per_minute: int | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.webhook_base = webhook_base.rstrip("/") if webhook_base else None
        self.state = SandboxState(Limits(per_bot_per_second, per_private_chat_per_second, per_group_per_minute))
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._webhook_client: httpx.Client | None = None
        self._client_lock = threading.Lock()

    @property
    def base_url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:8081``; PTB wants ``f"{base_url}/bot"``."""
        # A wildcard bind is not a connectable address; point clients at loopback.
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host  # noqa: S104
        return f"http://{host}:{self.port}"

    @property
    def bot_api_url(self) -> str:
        return f"{self.base_url}/bot"

    def bind(self) -> None:
        """Create the listening socket (idempotent); afterwards ``port`` is the real port."""
        if self._httpd is None:
            self._httpd = _HTTPServer((self.host, self.port), self)
            self.port = self._httpd.server_address[1]

    def start(self) -> SandboxServer:
        """Serve in a background daemon thread; returns once the socket is listening.

        After `stop()` it listens again on the same port with the same state (recorded calls,
        messages, faults), so a test can refuse connections for a while and then come back."""
        self.state.stopping = False
        self.bind()
        assert self._httpd is not None
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"bot-api-sandbox:{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until ``stop()`` is called from another thread."""
        self.bind()
        assert self._httpd is not None
        try:
            self._httpd.serve_forever(poll_interval=0.1)
        finally:
            self._close()

    def stop(self) -> None:
        """Stop listening and cut open connections (requests in flight get no answer);
        the state is kept for a later `start()`."""
        httpd = self._httpd
        if httpd is None:
            return
        self.state.stop()  # wake long-polling getUpdates so their threads finish
        httpd.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._close()

    def _close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.server_close()
            httpd.close_connections()
        with self._client_lock:
            client, self._webhook_client = self._webhook_client, None
        if client is not None:
            client.close()

    def __enter__(self) -> SandboxServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ webhooks
    def webhook_target(self, url: str) -> str:
        if self.webhook_base is None:
            return url
        parts = urlsplit(url)
        path = parts.path if parts.scheme else url.split("?", 1)[0]
        target = self.webhook_base + (path if path.startswith("/") else "/" + path)
        return f"{target}?{parts.query}" if parts.query else target

    def push_update(self, spec: JSONDict) -> JSONDict:
        token, update, webhook = self.state.build_update(spec)
        if webhook is None:
            return {"ok": True, "update": update, "queued": True}
        headers = {"Content-Type": "application/json"}
        if webhook.secret_token:
            headers["X-Telegram-Bot-Api-Secret-Token"] = webhook.secret_token
        status: int | None = None
        error: str | None = None
        try:
            # Delivered outside the state lock: the webhook handler may call back into us.
            response = self._client().post(
                self.webhook_target(webhook.url),
                content=_json_bytes(update),
                headers=headers,
            )
            status = response.status_code
            if not 200 <= status < 300:
                error = f"Wrong response from the webhook: {status} {response.reason_phrase}"
        except httpx.HTTPError as exc:
            error = f"Connection failed: {exc.__class__.__name__}: {exc}"
        self.state.note_webhook_result(token, update, status, error)
        result: JSONDict = {"ok": True, "update": update, "webhook_status": status}
        if error is not None:
            result["webhook_error"] = error
        return result

    def _client(self) -> httpx.Client:
        with self._client_lock:
            if self._webhook_client is None:
                self._webhook_client = httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0))
            return self._webhook_client


def serve_until_signalled(server: SandboxServer, announce: Callable[[str], None]) -> None:
    """Run ``server`` in the foreground; SIGINT/SIGTERM stop it cleanly."""

    def _on_signal(signum: int, frame: object) -> None:
        # shutdown() waits for serve_forever() to return, and serve_forever() runs in
        # this (main) thread, so the stop has to happen in a helper thread.
        threading.Thread(target=server.stop, name="sandbox-stop", daemon=True).start()

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.bind()
        announce(f"Bot API sandbox listening on {server.base_url}")
        server.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """CLI flags shared by ``manage.py telegram_sandbox`` and ``python -m``."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--webhook-base", default=None, help="deliver webhooks under this base URL")
    parser.add_argument("--bot-rate", type=int, default=None, help="messages per second per bot")
    parser.add_argument(
        "--private-chat-rate",
        type=int,
        default=None,
        help="messages per second per private chat",
    )
    parser.add_argument(
        "--group-rate-per-minute",
        type=int,
        default=None,
        help="messages per minute per group",
    )


def server_from_options(options: dict[str, Any]) -> SandboxServer:
    return SandboxServer(
        host=options["host"],
        port=options["port"],
        webhook_base=options.get("webhook_base"),
        per_bot_per_second=options.get("bot_rate"),
        per_private_chat_per_second=options.get("private_chat_rate"),
        per_group_per_minute=options.get("group_rate_per_minute"),
    )


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Telegram Bot API sandbox")
    add_arguments(parser)
    options = vars(parser.parse_args(list(argv) if argv is not None else None))

    def announce(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    serve_until_signalled(server_from_options(options), announce)


if __name__ == "__main__":
    main(sys.argv[1:])
