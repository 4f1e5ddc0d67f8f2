"""Local stand-ins for the other side of a consumer: a fake CRM and a fake OpenAI-compatible
chat-completions endpoint, real HTTP servers (stdlib http.server) on 127.0.0.1 in a thread.
Plus helpers that drive the inbox pipeline in-process (store, route, run, deliver).

With inline work on (the default) routing also runs the inline-safe consumers (the echo
auto-reply, analytics), and a run sends the replies it wrote right after their commit. That
send waits for the commit: a test that expects it needs `django_db(transaction=True)` (in a
test's rolled-back transaction the replies stay claimed, unsent, and `deliver` skips them).
The helpers that run consumers return once the answers of those sends are recorded too."""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
from django.conf import settings
from django.utils import timezone

from bots.inbox import inbox_update_store
from bots.models import Bot, ConsumerRun, InboundUpdate, RunState
from bots.routing import inbox_update_route, inbox_updates_route
from bots.runs import consumer_run_execute
from outbox.models import OutboundMessage, State
from outbox.sending.late import late_answers
from tests.outbox.helpers import drive

_update_ids = itertools.count(1000)


class FakeServer:
    """An HTTP server whose answers come from `handle(method, path, headers, body)`."""

    def __init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                status, answer = owner.handle(self.command, self.path, dict(self.headers), body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> FakeServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, method: str, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        raise NotImplementedError


class FakeCRM(FakeServer):
    """Counts leads by Idempotency-Key - and does NOT deduplicate them, so a second POST of
    the same lead shows up as a count of 2. GET /leads?idempotency_key=K says whether it
    has one (the lookup the crm_webhook consumer asks before a retry).

    `failures` is a list of what the next POSTs meet: "down" (503, nothing stored) or
    "lost_answer" (the lead IS stored, then 502 - the answer is lost on the way back)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[str] = []
        self.posts: list[dict[str, Any]] = []
        self.leads: Counter[str] = Counter()

    def handle(self, method: str, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        with self.lock:
            if method == "GET":
                key = parse_qs(urlparse(path).query).get("idempotency_key", [""])[0]
                return 200, {"found": self.leads[key] > 0}
            key = headers.get("Idempotency-Key", "")
            self.posts.append({"key": key, "body": body, "headers": headers})
            failure = self.failures.pop(0) if self.failures else None
            if failure == "down":
                return 503, {"error": "maintenance"}
            self.leads[key] += 1
            if failure == "lost_answer":
                return 502, {"error": "bad gateway"}
            return 201, {"id": f"lead-{len(self.leads)}"}


def crm_lookup(key: str, ctx: Any) -> bool:
    """DOVECOTE_CRM_LOOKUP hook for FakeCRM: ask the CRM whether it has the lead."""
    response = httpx.get(f"{settings.DOVECOTE_CRM_WEBHOOK_URL.rstrip('/')}", params={"idempotency_key": key}, timeout=5)
    response.raise_for_status()
    return bool(response.json()["found"])


class FakeOpenAI(FakeServer):
    """POST /v1/chat/completions: records each request and answers with `reply`, or with
    the status codes queued in `statuses` first."""

    def __init__(self, reply: str = "Hello from the model") -> None:
        super().__init__()
        self.reply = reply
        self.statuses: list[int] = []
        self.requests: list[dict[str, Any]] = []

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def handle(self, method: str, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        with self.lock:
            self.requests.append({"path": path, "headers": headers, "body": body})
            if self.statuses:
                status = self.statuses.pop(0)
                return status, {"error": {"message": f"fake {status}"}}
        return 200, {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.reply}, "finish_reason": "stop"}],
        }


# --- driving the pipeline in-process -------------------------------------------------------


def message_update(
    *,
    chat_id: int,
    text: str,
    message_id: int,
    update_id: int | None = None,
    chat_type: str = "private",
    date: int | None = None,
) -> dict[str, Any]:
    user = {"id": abs(chat_id), "is_bot": False, "first_name": "Alice"}
    return {
        "update_id": next(_update_ids) if update_id is None else update_id,
        "message": {
            "message_id": message_id,
            "date": int(timezone.now().timestamp()) if date is None else date,
            "chat": {"id": chat_id, "type": chat_type, "first_name": "Alice"},
            "from": user,
            "text": text,
        },
    }


def store(bot: Bot, payload: dict[str, Any]) -> InboundUpdate:
    """What the webhook does: the update stored, not routed yet."""
    return inbox_update_store(bot=bot, payload=payload)[0]


def answered() -> None:
    """Wait for the answers an inline send left to this process's late-answers thread
    (outbox/sending/late.py): on a busy host the sandbox may answer after the send stops
    waiting, and the test reads what was sent."""
    assert late_answers.drain(timeout=30), "late answers still out after 30 s"


def route(update: InboundUpdate) -> list[int]:
    """What the per-update route task (the sweeper's redispatch) does; the runs' ids."""
    runs = inbox_update_route(update.pk)
    answered()
    return runs


def route_all(bot: Bot) -> int:
    """One router pass over the bot's new updates; how many it routed."""
    n = inbox_updates_route(bot.pk)
    answered()
    return n


def receive(bot: Bot, payload: dict[str, Any]) -> InboundUpdate:
    """What the webhook does (store), then what the route task does (with inline work, the
    inline-safe runs too)."""
    update = store(bot, payload)
    route(update)
    return update


def run_of(update: InboundUpdate, consumer: str) -> ConsumerRun:
    return ConsumerRun.objects.get(update=update, consumer=consumer)


def execute(update: InboundUpdate, consumer: str, *, due_now: bool = False) -> str:
    """One worker pass over the update's run of `consumer`; `due_now` skips a scheduled wait
    (a retry's backoff) as if that time had passed."""
    run = run_of(update, consumer)
    if due_now:
        ConsumerRun.objects.filter(pk=run.pk, state__in=[RunState.PENDING, RunState.RETRY]).update(
            next_attempt_at=timezone.now()
        )
    outcome = consumer_run_execute(run.pk)
    answered()
    return outcome


def deliver(bot: Bot) -> list[str]:
    """Send every waiting outbox message of the bot to the sandbox, oldest first, waiting
    out the rate limits (one message a second in a private chat) as a worker would."""
    pending = OutboundMessage.objects.filter(bot=bot, state=State.PENDING).order_by("pk")
    return [drive(pk)[0].status for pk in pending.values_list("pk", flat=True)]
