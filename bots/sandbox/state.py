"""The sandbox's in-memory state: the calls it recorded, the messages it "delivered" per
bot and chat, pushed updates and webhooks, flood-limit windows and injected faults.

Everything here is guarded by one lock, ``SandboxState.lock``; the Bot API methods
(``bots.sandbox.methods``) run under it and build on the helpers below.
"""

from __future__ import annotations

import math
import re
import secrets
import threading
import time
import zlib
from collections import deque
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any

__all__ = [
    "FAULT_KINDS",
    "INT_RE",
    "TOKEN_RE",
    "ApiError",
    "Call",
    "ControlError",
    "Fault",
    "JSONDict",
    "Limits",
    "SandboxState",
    "StoredMessage",
    "Webhook",
    "bot_user",
    "chat_ref_to_int",
    "opt_float",
    "opt_int",
    "status_phrase",
]

JSONDict = dict[str, Any]

INT_RE = re.compile(r"-?\d+")
TOKEN_RE = re.compile(r"(\d+):[^/\s]+")

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
    # Each call reaches the counters up to this many milliseconds late (uniformly), as over
    # a real network: requests sent evenly arrive bunched, and a strict window counts them so.
    arrival_jitter_ms: float = 0.0


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
class Call:
    """The per-call context handed to method implementations."""

    token: str
    method: str
    params: JSONDict
    chat_id: int | None
    record: JSONDict
    bot: JSONDict = field(default_factory=dict)


def _bot_id(token: str) -> int:
    return int(token.split(":", 1)[0])


def bot_user(token: str) -> JSONDict:
    bot_id = _bot_id(token)
    return {
        "id": bot_id,
        "is_bot": True,
        "first_name": "Sandbox Bot",
        "username": f"{bot_id}_sandbox_bot",
    }


def chat_ref_to_int(value: Any) -> int | None:
    """Numeric chat id of a parameter value, or None (``@username`` or garbage)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and INT_RE.fullmatch(value.strip()):
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
        # Files a user sent (a pushed photo), by (token, file_id): (file_path, content).
        self.files: dict[tuple[str, str], tuple[str, bytes]] = {}

    def reset(self, continue_after: JSONDict | None = None) -> None:
        """Forget everything. `continue_after` ({token: {"update_id": N, "message_ids": {chat:
        N}}}) continues a bot's update ids and its chats' message ids after those a previous
        sandbox gave, as Telegram's keep increasing: a bot that stored them would take reissued
        ones for updates it has seen (dropped) and messages it has answered."""
        with self.lock:
            self._reset_locked()
            for token, last in (continue_after or {}).items():
                if not isinstance(token, str) or not isinstance(last, dict):
                    raise ControlError("continue_after maps each token to {update_id, message_ids}")
                update_id = _count(last.get("update_id", 0), "update_id")
                self.update_counters[token] = update_id
                chats = last.get("message_ids", {})
                if not isinstance(chats, dict):
                    raise ControlError("message_ids maps each chat id to the last message_id in it")
                for chat, message_id in chats.items():
                    chat_id = chat_ref_to_int(chat)
                    if chat_id is None:
                        raise ControlError(f"message_ids: {chat!r} is not a chat id")
                    self.chat_counters[(token, chat_id)] = _count(message_id, "message_id")
            self.updates_arrived.notify_all()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.updates_arrived.notify_all()

    # --------------------------------------------------------------------- call log
    def append_call(self, record: JSONDict) -> None:
        """Number ``record`` and log it; the caller holds ``lock``."""
        record["id"] = self.next_call_id
        self.next_call_id += 1
        self.calls.append(record)

    # ----------------------------------------------------------------------- faults
    def add_fault(self, spec: JSONDict) -> Fault:
        kind = str(spec.get("kind", "")).lower()
        status = opt_int(spec, "status")
        if kind.isdigit() and len(kind) == 3 and kind.startswith("5"):
            # Accept "502"-style kinds as a convenience for {"kind": "5xx", "status": 502}.
            status, kind = status or int(kind), "5xx"
        if kind not in FAULT_KINDS:
            raise ControlError(f"unknown fault kind {spec.get('kind')!r}; one of {sorted(FAULT_KINDS)}")
        count = opt_int(spec, "count")
        seconds = opt_float(spec, "seconds")
        delay = opt_float(spec, "delay")
        chat_id = spec.get("chat_id")
        if chat_id is not None and chat_ref_to_int(chat_id) is None:
            raise ControlError("chat_id must be an integer")
        now = time.monotonic()
        with self.lock:
            fault = Fault(
                id=self.next_fault_id,
                kind=kind,
                token=spec.get("token") or None,
                method=spec.get("method") or None,
                chat_id=chat_ref_to_int(chat_id),
                count=count,
                seconds=seconds,
                retry_after=opt_int(spec, "retry_after") or 5,
                delay=1.0 if delay is None else delay,
                status=status or 502,
                migrate_to_chat_id=opt_int(spec, "migrate_to_chat_id"),
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

    def match_fault(self, token: str, method: str, chat_id: int | None) -> Fault | None:
        """The fault this call runs into, its hit counted; the caller holds ``lock``."""
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
    def fault_error(fault: Fault, chat_id: int | None) -> ApiError | None:
        """The error ``fault`` answers instead of performing the call, if it answers one."""
        if fault.kind == "429":
            ra = max(1, fault.retry_after)
            return ApiError(429, f"Too Many Requests: retry after {ra}", {"retry_after": ra})
        if fault.kind == "5xx":
            text = _SERVER_ERROR_TEXT.get(fault.status) or status_phrase(fault.status)
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

    def target_chat(self, call: Call, param: str = "chat_id") -> JSONDict:
        """The chat object a call's ``param`` names (an id or ``@username``), or a 400."""
        raw = call.params.get(param)
        if raw is None or raw == "":
            raise ApiError(400, f"Bad Request: {param} is empty")
        chat_id = chat_ref_to_int(raw)
        if chat_id is not None and chat_id != 0:
            return _chat_object(chat_id)
        if isinstance(raw, str) and raw.startswith("@") and len(raw) > 1:
            return _chat_object(_username_chat_id(raw[1:]), "channel", raw[1:])
        raise ApiError(400, "Bad Request: chat not found")

    def create_message(self, call: Call, chat: JSONDict, content: JSONDict) -> JSONDict:
        """Store the bot's new message in ``chat`` under the flood limits; returns a copy."""
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

    def _reply_target(self, call: Call, chat_id: int) -> JSONDict | None:
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

    def find_message(self, call: Call, description: str) -> StoredMessage:
        """The live message a call's ``chat_id``/``message_id`` name, or a 400 ``description``."""
        chat = self.target_chat(call)
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
        if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):
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
        chat_id = chat_ref_to_int(spec.get("chat_id"))
        if chat_id is None or chat_id == 0:
            raise ControlError("chat_id (non-zero integer) is required")
        user_id = chat_ref_to_int(spec.get("user_id")) or abs(chat_id)
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
        photo = bool(spec.get("photo"))
        if not photo and (not isinstance(text, str) or not text):
            raise ControlError("text (non-empty string) is required")
        message_id = chat_ref_to_int(spec.get("message_id"))
        if message_id is None:
            message_id = self._next_message_id(token, chat_id)
        else:
            self.chat_counters[(token, chat_id)] = max(self.chat_counters.get((token, chat_id), 0), message_id)
        message: JSONDict = {
            "message_id": message_id,
            "from": user,
            "chat": chat,
            "date": int(time.time()),
        }
        if photo:
            message["photo"] = self._user_photo(token)
            if isinstance(text, str) and text:
                message["caption"] = text
        else:
            message["text"] = text
        if not photo and isinstance(text, str) and text.startswith("/"):
            # PTB's CommandHandler only fires on a bot_command entity at offset 0.
            command = text.split(maxsplit=1)[0]
            message["entities"] = [{"type": "bot_command", "offset": 0, "length": len(command)}]
        self.messages[(token, chat_id, message_id)] = StoredMessage(token, chat_id, message_id, message, False, "push")
        return {"message": message}

    def _user_photo(self, token: str) -> list[JSONDict]:
        """A photo a user sends: its sizes, each a file the bot can get (getFile) and
        download (/file/bot<token>/<file_path>), its content made up."""
        sizes = []
        for width, height in ((90, 67), (320, 240), (800, 600)):
            file_id, unique = "AgACAgIAAxkBAAI" + secrets.token_urlsafe(24), secrets.token_urlsafe(8)
            content = f"sandbox photo {width}x{height} {unique}".encode()
            self.files[(token, file_id)] = (f"photos/file_{unique}.jpg", content)
            sizes.append(
                {
                    "file_id": file_id,
                    "file_unique_id": unique,
                    "width": width,
                    "height": height,
                    "file_size": len(content),
                }
            )
        return sizes

    def file_content(self, token: str, file_path: str) -> bytes | None:
        with self.lock:
            return next((c for (t, _), (p, c) in self.files.items() if t == token and p == file_path), None)

    def _callback_query(self, token: str, spec: JSONDict, user: JSONDict, chat: JSONDict) -> JSONDict:
        query: JSONDict = {
            "id": str(secrets.randbits(63)),
            "from": user,
            "chat_instance": str(zlib.crc32(f"{token}:{chat['id']}".encode())),
            "data": str(spec["callback_data"]),
        }
        message_id = chat_ref_to_int(spec.get("message_id"))
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


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def opt_int(spec: JSONDict, key: str) -> int | None:
    value = spec.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ControlError(f"{key} must be an integer") from None


def opt_float(spec: JSONDict, key: str) -> float | None:
    value = spec.get(key)
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ControlError(f"{key} must be a number") from None


def _count(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ControlError(f"{name} must be an integer >= 0")
    return value
