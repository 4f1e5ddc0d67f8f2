"""The sandbox's HTTP side: request parsing, the Bot API route and the control API.

Only the standard library is used for serving (plus httpx, in ``server``, to push updates
to webhooks), so it starts in milliseconds inside tests and needs no services.
"""

from __future__ import annotations

import binascii
import contextlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from bots.sandbox.methods import bot_call, record_error
from bots.sandbox.state import (
    INT_RE,
    ApiError,
    ControlError,
    JSONDict,
    Limits,
    SandboxState,
    chat_ref_to_int,
    opt_float,
    opt_int,
    status_phrase,
)

__all__ = ["SandboxHTTPServer", "json_bytes"]

logger = logging.getLogger(__name__)

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
_BOT_PATH_RE = re.compile(r"/bot([^/]*)/([^/]*)/?")
_FILE_PATH_RE = re.compile(r"/file/bot([^/]*)/(.+)")
_CONTROL_PREFIX = "/sandbox/"
_MAX_LINE = 65536
_MAX_HEADERS = 100


def _coerce_param(name: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if name in _INT_PARAMS and INT_RE.fullmatch(value):
        return int(value)
    if name in _BOOL_PARAMS and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if value and value[0] in "{[":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


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


def json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def _flag(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.lower() in ("1", "true", "yes", "on")


class _Handler(BaseHTTPRequestHandler):
    server: SandboxHTTPServer
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
        """Parse one request without ``email``, whose parser the standard path pays on every call."""
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
        self._respond_bytes(status, json_bytes(payload), content_type="application/json")

    def _respond_bytes(self, status: int, body: bytes, *, content_type: str = "application/octet-stream") -> None:
        head = (
            f"HTTP/1.1 {status} {status_phrase(status)}\r\n"
            f"Content-Type: {content_type}\r\n"
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
        state = self.server.state
        if path.startswith(_CONTROL_PREFIX):
            self._control(path[len(_CONTROL_PREFIX) :].strip("/"), split.query, body)
            return
        download = _FILE_PATH_RE.fullmatch(path)
        if download is not None:
            content = state.file_content(unquote(download.group(1)), unquote(download.group(2)))
            if content is None:
                self._respond(404, {"ok": False, "error_code": 404, "description": "Not Found"})
            else:
                self._respond_bytes(200, content)
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
            outcome = record_error(state, token, method, arrived, error)
        else:
            outcome = bot_call(state, token, method, params, arrived)
        if outcome.body is None:
            self._drop()
            return
        if outcome.delay > 0:
            time.sleep(outcome.delay)  # "slow" fault: the call already took effect
        self._respond(outcome.status, outcome.body)

    # ------------------------------------------------------------- control API
    def _control(self, route: str, query: str, body: bytes) -> None:
        verb = self.command
        args = dict(parse_qsl(query))
        state = self.server.state
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
                    chat_id=chat_ref_to_int(args.get("chat_id")),
                    delivered=_flag(args.get("delivered")),
                    after=chat_ref_to_int(args.get("after")),
                )
                self._respond(200, {"calls": calls})
            elif route == "messages" and verb == "GET":
                messages = state.list_messages(
                    args.get("token") or None,
                    chat_ref_to_int(args.get("chat_id")),
                    bool(_flag(args.get("include_deleted"))),
                )
                self._respond(200, {"messages": messages})
            elif route == "reset" and verb == "POST":
                state.reset(spec.get("continue_after"))
                self._respond(200, {"ok": True})
            elif route == "faults" and verb == "POST":
                fault = state.add_fault(spec)
                self._respond(200, {"ok": True, **fault.public()})
            elif route == "faults" and verb == "GET":
                self._respond(200, {"faults": state.list_faults()})
            elif route == "faults" and verb == "DELETE":
                self._respond(200, {"ok": True, "cleared": state.clear_faults()})
            elif route.startswith("faults/") and verb == "DELETE":
                fault_id = chat_ref_to_int(route[7:])
                if fault_id is None:
                    raise ControlError("fault id must be an integer")
                self._respond(200, {"ok": True, "cleared": state.clear_faults(fault_id)})
            elif route == "limits" and verb == "POST":
                limits = Limits(
                    per_bot_per_second=opt_int(spec, "per_bot_per_second"),
                    per_private_chat_per_second=opt_int(spec, "per_private_chat_per_second"),
                    per_group_per_minute=opt_int(spec, "per_group_per_minute"),
                    arrival_jitter_ms=opt_float(spec, "arrival_jitter_ms") or 0.0,
                )
                state.set_limits(limits)
                self._respond(200, {"ok": True, **asdict(limits)})
            elif route == "limits" and verb == "GET":
                with state.lock:
                    current = asdict(state.limits)
                self._respond(200, current)
            elif route == "updates" and verb == "POST":
                self._respond(200, self.server.push_update(spec))
            elif route == "updates" and verb == "GET":
                self._respond(200, {"updates": state.list_pushed(args.get("token") or None)})
            else:
                self._respond(
                    404,
                    {"ok": False, "error": f"no control route {verb} /sandbox/{route}"},
                )
        except (ControlError, ValueError) as exc:
            self._respond(400, {"ok": False, "error": str(exc)})


class SandboxHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # long-polls and idle keep-alive connections must not block exit
    block_on_close = False
    request_queue_size = 128  # benchmarks open many connections at once

    def __init__(
        self,
        address: tuple[str, int],
        state: SandboxState,
        push_update: Callable[[JSONDict], JSONDict],
    ) -> None:
        # Pushing an update delivers webhooks, which the server above owns; it is handed in
        # so this module does not import the server.
        self.state = state
        self.push_update = push_update
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
