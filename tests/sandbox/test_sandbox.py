"""Tests for the Telegram Bot API sandbox: real HTTP, a real python-telegram-bot client.

No Django and no database: the server runs in-thread on a free port.
"""

from __future__ import annotations

import asyncio
import datetime as dtm
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import telegram
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TimedOut,
)
from telegram.request import HTTPXRequest

from bots.sandbox.client import SandboxClient, SandboxControlError
from bots.sandbox.server import SandboxServer

TOKEN = "123456:TEST-token_abc"
OTHER_TOKEN = "777:other"
# RetryAfter.retry_after warns about its future timedelta type; seconds() handles both.
pytestmark = pytest.mark.filterwarnings("ignore:.*retry_after.*:telegram.warnings.PTBDeprecationWarning")
REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


# ------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def server() -> Iterator[SandboxServer]:
    srv = SandboxServer(port=0).start()
    yield srv
    srv.stop()


@pytest.fixture
def sandbox(server: SandboxServer) -> Iterator[SandboxClient]:
    client = SandboxClient(server.base_url)
    client.reset()
    yield client
    client.close()


def run_bot(
    server: SandboxServer,
    body: Callable[[telegram.Bot], Awaitable[T]],
    *,
    token: str = TOKEN,
    request: HTTPXRequest | None = None,
) -> T:
    """Run ``body(bot)`` with an initialised PTB bot pointed at the sandbox."""

    async def main() -> T:
        bot = telegram.Bot(token, base_url=server.bot_api_url, request=request)
        async with bot:
            return await body(bot)

    return asyncio.run(main())


def seconds(value: int | dtm.timedelta) -> float:
    # PTB 22 may expose time periods as int or timedelta depending on PTB_TIMEDELTA.
    return value.total_seconds() if isinstance(value, dtm.timedelta) else float(value)


class WebhookReceiver:
    """A tiny local HTTP endpoint standing in for the project's webhook view."""

    def __init__(self, status: int = 200) -> None:
        self.received: list[dict[str, Any]] = []
        self.status = status
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.received.append({"path": self.path, "headers": dict(self.headers), "update": json.loads(body)})
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    rec = WebhookReceiver()
    yield rec
    rec.close()


# ------------------------------------------------------------------- basic surface
def test_get_me_and_send_message_are_parsed_and_recorded(server: SandboxServer, sandbox: SandboxClient) -> None:
    async def body(bot: telegram.Bot) -> tuple[telegram.User, list[telegram.Message]]:
        me = await bot.get_me()
        sent = [await bot.send_message(42, f"hello {i}") for i in range(3)]
        sent.append(await bot.send_message(-100500, "to the group"))
        return me, sent

    me, sent = run_bot(server, body)
    assert (me.id, me.is_bot, me.username) == (123456, True, "123456_sandbox_bot")
    assert [m.message_id for m in sent] == [1, 2, 3, 1]  # per-chat counters
    assert all(isinstance(m, telegram.Message) for m in sent)
    assert sent[0].text == "hello 0"
    assert sent[0].from_user is not None
    assert sent[0].from_user.id == 123456
    assert sent[0].chat.type == "private"
    assert sent[3].chat.type == "supergroup"

    calls = sandbox.calls(token=TOKEN, method="sendmessage")  # method matches any case
    assert [c["params"]["text"] for c in calls] == ["hello 0", "hello 1", "hello 2", "to the group"]
    first = calls[0]
    assert first["chat_id"] == 42
    assert first["status"] == 200
    assert first["delivered"] is True
    assert first["result"]["message_id"] == 1
    assert isinstance(first["at"], float)
    assert sandbox.sent_texts(chat_id=42) == ["hello 0", "hello 1", "hello 2"]
    assert len(sandbox.messages(token=TOKEN, chat_id=42)) == 3
    ids = [c["id"] for c in sandbox.calls()]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)


def test_validation_errors_and_unknown_methods(server: SandboxServer, sandbox: SandboxClient) -> None:
    async def body(bot: telegram.Bot) -> None:
        with pytest.raises(BadRequest, match="too long"):
            await bot.send_message(1, "x" * 4097)
        assert (await bot.send_message(1, "x" * 4096)).message_id == 1
        with pytest.raises(BadRequest, match="text is empty"):
            await bot.send_message(1, "   ")

    run_bot(server, body)
    with httpx.Client(base_url=server.base_url) as http:
        r = http.post(f"/bot{TOKEN}/sendCarrierPigeon", json={"chat_id": 1})
        assert r.status_code == 404
        assert r.json() == {"ok": False, "error_code": 404, "description": "Not Found"}
        r = http.post("/botnot-a-token/getMe")
        assert r.status_code == 404
        r = http.post(f"/bot{TOKEN}/SENDMESSAGE", json={"chat_id": 1, "text": "caps"})
        assert r.status_code == 200
        assert r.json()["result"]["message_id"] == 2
        r = http.post(f"/bot{TOKEN}/sendMessage", json={"text": "no chat"})
        assert r.status_code == 400
        assert r.json()["description"] == "Bad Request: chat_id is empty"
    assert sandbox.calls(method="sendCarrierPigeon")[0]["status"] == 404
    assert [c["delivered"] for c in sandbox.calls(method="sendMessage")] == [
        False,
        True,
        False,
        True,
        False,
    ]


def test_lengths_are_counted_as_telegram_does_in_utf16_units_after_parsing(
    server: SandboxServer, sandbox: SandboxClient
) -> None:
    async def body(bot: telegram.Bot) -> None:
        # An emoji outside the BMP is two UTF-16 units: 2,049 of them are 4,098.
        with pytest.raises(BadRequest, match="too long"):
            await bot.send_message(1, "😀" * 2049)
        assert await bot.send_message(1, "😀" * 2048)
        # HTML tags do not count and &amp; is one character.
        assert await bot.send_message(1, "<b>" + "&amp;" * 4096 + "</b>", parse_mode="HTML")
        with pytest.raises(BadRequest, match="too long"):
            await bot.send_message(1, "<b>" + "&amp;" * 4097 + "</b>", parse_mode="HTML")
        # Without a parse_mode the same markup is text, and counts.
        with pytest.raises(BadRequest, match="too long"):
            await bot.send_message(1, "<b>" + "x" * 4090 + "</b>")
        assert await bot.send_message(1, "*" + "x" * 4096 + "*", parse_mode="MarkdownV2")
        with pytest.raises(BadRequest, match="caption is too long"):
            await bot.send_photo(1, "file-1", caption="😀" * 513)
        assert await bot.send_photo(1, "file-1", caption="<i>" + "x" * 1024 + "</i>", parse_mode="HTML")

    run_bot(server, body)
    sends = [c["status"] for c in sandbox.calls(token=TOKEN) if c["method"] != "getMe"]
    assert sends == [400, 200, 200, 400, 400, 200, 400, 200]


def test_form_json_query_and_multipart_bodies(server: SandboxServer, sandbox: SandboxClient) -> None:
    markup = {"inline_keyboard": [[{"text": "Yes", "callback_data": "y"}]]}
    with httpx.Client(base_url=f"{server.base_url}/bot{TOKEN}") as http:
        form = http.post(
            "/sendMessage",
            data={"chat_id": "5", "text": "form", "reply_markup": json.dumps(markup)},
        )
        as_json = http.post("/sendMessage", json={"chat_id": 5, "text": "json"})
        query = http.get("/sendMessage", params={"chat_id": "5", "text": "query"})
    for response in (form, as_json, query):
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/json"
    assert form.json()["result"]["reply_markup"] == markup
    recorded = sandbox.calls(method="sendMessage")
    assert recorded[0]["params"] == {"chat_id": 5, "text": "form", "reply_markup": markup}
    assert [c["chat_id"] for c in recorded] == [5, 5, 5]
    assert [r.json()["result"]["message_id"] for r in (form, as_json, query)] == [1, 2, 3]

    async def body(bot: telegram.Bot) -> tuple[telegram.Message, telegram.Message]:
        photo = await bot.send_photo(5, b"\x89PNG not really", caption="pic")
        doc = await bot.send_document(5, b"col1,col2\n", filename="report.csv")
        return photo, doc

    photo, doc = run_bot(server, body)
    assert photo.photo
    assert photo.caption == "pic"
    assert doc.document is not None
    assert doc.document.file_name == "report.csv"
    upload = sandbox.calls(method="sendDocument")[0]["params"]["document"]
    assert upload["_upload"] is True
    assert upload["filename"] == "report.csv"
    assert upload["size"] == len(b"col1,col2\n")


def test_edit_delete_copy_and_callbacks(server: SandboxServer, sandbox: SandboxClient) -> None:
    async def body(bot: telegram.Bot) -> None:
        sent = await bot.send_message(9, "draft")
        edited = await bot.edit_message_text("final", chat_id=9, message_id=sent.message_id)
        assert isinstance(edited, telegram.Message)
        assert edited.text == "final"
        with pytest.raises(BadRequest, match="not modified"):
            await bot.edit_message_text("final", chat_id=9, message_id=sent.message_id)
        copied = await bot.copy_message(10, from_chat_id=9, message_id=sent.message_id)
        assert copied.message_id == 1
        assert await bot.delete_message(9, sent.message_id) is True
        with pytest.raises(BadRequest, match="not found"):
            await bot.delete_message(9, sent.message_id)
        assert await bot.answer_callback_query("cb-1", text="ok") is True

    run_bot(server, body)
    assert sandbox.messages(chat_id=9) == []
    assert sandbox.messages(chat_id=9, include_deleted=True)[0]["message"]["text"] == "final"
    assert sandbox.messages(chat_id=10)[0]["message"]["text"] == "final"


# ------------------------------------------------------------------------- faults
FAULT_CASES = [
    ("429", {"retry_after": 7}, RetryAfter, 429),
    ("403", {}, Forbidden, 403),
    ("400", {}, BadRequest, 400),
    ("401", {}, InvalidToken, 401),
    ("migrate", {"migrate_to_chat_id": -1009876}, ChatMigrated, 400),
    ("5xx", {}, NetworkError, 502),
    ("5xx", {"status": 500}, NetworkError, 500),
    ("drop_before", {}, NetworkError, None),
]


@pytest.mark.parametrize(("kind", "params", "exc_type", "status"), FAULT_CASES)
def test_fault_kinds_surface_as_ptb_exceptions(
    server: SandboxServer,
    sandbox: SandboxClient,
    kind: str,
    params: dict[str, Any],
    exc_type: type[Exception],
    status: int | None,
) -> None:
    fault = sandbox.fault(kind, method="sendMessage", **params)
    assert isinstance(fault["id"], int)

    async def body(bot: telegram.Bot) -> Exception:
        with pytest.raises(exc_type) as info:
            await bot.send_message(-55, "doomed")
        return info.value

    error = run_bot(server, body)
    if isinstance(error, RetryAfter):
        assert seconds(error.retry_after) == 7
    if isinstance(error, ChatMigrated):
        assert error.new_chat_id == -1009876
    (call,) = sandbox.calls(method="sendMessage")
    assert call["status"] == status
    assert call["delivered"] is False
    assert call["fault"] == fault["id"]
    assert sandbox.messages() == []


def test_drop_after_deliver_raises_but_the_message_exists(server: SandboxServer, sandbox: SandboxClient) -> None:
    sandbox.fault("drop_after_deliver", method="sendMessage", count=1)

    async def body(bot: telegram.Bot) -> telegram.Message:
        with pytest.raises(NetworkError):
            await bot.send_message(7, "maybe")
        return await bot.send_message(7, "again")  # the client reconnects afterwards

    again = run_bot(server, body)
    assert again.message_id == 2
    dropped, ok = sandbox.calls(method="sendMessage")
    assert dropped["delivered"] is True
    assert dropped["status"] is None
    assert dropped["result"]["message_id"] == 1
    assert ok["status"] == 200
    assert len(sandbox.messages(chat_id=7)) == 2


def test_slow_fault_times_out_in_ptb_but_is_delivered(server: SandboxServer, sandbox: SandboxClient) -> None:
    sandbox.fault("slow", method="sendMessage", delay=0.8, count=1)
    request = HTTPXRequest(read_timeout=0.25)

    async def body(bot: telegram.Bot) -> None:
        with pytest.raises(TimedOut):
            await bot.send_message(3, "slowly")

    run_bot(server, body, request=request)
    (call,) = sandbox.calls(method="sendMessage")
    assert call["delivered"] is True
    assert call["status"] == 200

    # With a patient client the slow call simply succeeds after the delay.
    sandbox.fault("slow", method="sendMessage", delay=0.3, count=1)
    started = time.monotonic()
    message = run_bot(server, lambda bot: bot.send_message(3, "patient"))
    assert message.message_id == 2
    assert time.monotonic() - started >= 0.3


def test_fault_count_seconds_and_matching(server: SandboxServer, sandbox: SandboxClient) -> None:
    async def outcomes(bot: telegram.Bot, chat_id: int, n: int) -> list[str]:
        result = []
        for _ in range(n):
            try:
                await bot.send_message(chat_id, "x")
                result.append("ok")
            except Forbidden:
                result.append("403")
            except BadRequest:
                result.append("400")
        return result

    sandbox.fault("403", method="sendMessage", count=2)
    assert run_bot(server, lambda bot: outcomes(bot, 1, 3)) == ["403", "403", "ok"]

    # Seconds enough for the send to start within them on a loaded host.
    sandbox.fault("403", seconds=2, method="sendMessage")
    assert run_bot(server, lambda bot: outcomes(bot, 1, 1)) == ["403"]
    time.sleep(2.1)
    assert run_bot(server, lambda bot: outcomes(bot, 1, 1)) == ["ok"]

    # Only the matching chat/token is affected; the first created matching fault wins.
    sandbox.fault("400", chat_id=500)
    sandbox.fault("403", chat_id=500)
    sandbox.fault("403", token=OTHER_TOKEN)
    assert run_bot(server, lambda bot: outcomes(bot, 500, 2)) == ["400", "400"]
    assert run_bot(server, lambda bot: outcomes(bot, 501, 1)) == ["ok"]
    assert len(sandbox.faults()) == 3
    sandbox.clear_faults()
    assert run_bot(server, lambda bot: outcomes(bot, 500, 1)) == ["ok"]

    with pytest.raises(SandboxControlError, match="unknown fault kind"):
        sandbox.fault("meteor")


# -------------------------------------------------------------------- flood limits
async def _flood(bot: telegram.Bot, chat_ids: list[int]) -> list[float | None]:
    """Send to each chat in turn; None for success, else the RetryAfter seconds."""
    result: list[float | None] = []
    for chat_id in chat_ids:
        try:
            await bot.send_message(chat_id, "flood")
            result.append(None)
        except RetryAfter as exc:
            result.append(seconds(exc.retry_after))
    return result


def test_per_bot_limit(server: SandboxServer, sandbox: SandboxClient) -> None:
    sandbox.limits(per_bot_per_second=3)
    assert run_bot(server, lambda bot: _flood(bot, [1, 2, 3, 4])) == [None, None, None, 1]
    assert len(sandbox.calls(method="sendMessage", delivered=True)) == 3
    assert sandbox.calls(method="sendMessage", delivered=False)[0]["status"] == 429
    # Another bot has its own budget.
    assert run_bot(server, lambda bot: _flood(bot, [1]), token=OTHER_TOKEN) == [None]
    time.sleep(1.05)
    assert run_bot(server, lambda bot: _flood(bot, [4])) == [None]


def test_arrival_jitter_delays_each_call_and_the_window_stays_strict(
    server: SandboxServer, sandbox: SandboxClient
) -> None:
    assert sandbox.limits(per_bot_per_second=3, arrival_jitter_ms=60)["arrival_jitter_ms"] == 60
    started = time.monotonic()
    # Sent one after another: 4 calls, each up to 60 ms late (30 on average).
    assert run_bot(server, lambda bot: _flood(bot, [1, 2, 3, 4])) == [None, None, None, 1]
    assert time.monotonic() - started > 0.01
    sandbox.limits()
    assert sandbox.limits()["arrival_jitter_ms"] == 0


def test_per_chat_limits(server: SandboxServer, sandbox: SandboxClient) -> None:
    sandbox.limits(per_private_chat_per_second=1, per_group_per_minute=2)
    assert run_bot(server, lambda bot: _flood(bot, [11, 11, 12])) == [None, 1, None]
    group = run_bot(server, lambda bot: _flood(bot, [-200, -200, -200]))
    assert group[:2] == [None, None]
    assert group[2] is not None
    assert 59 <= group[2] <= 60
    sandbox.limits()  # all off again
    assert run_bot(server, lambda bot: _flood(bot, [11, 11, -200])) == [None, None, None]


# ----------------------------------------------------------------- webhook/updates
def test_webhook_push_carries_secret_and_redelivery(
    server: SandboxServer, sandbox: SandboxClient, receiver: WebhookReceiver
) -> None:
    async def setup(bot: telegram.Bot) -> telegram.WebhookInfo:
        await bot.set_webhook(f"{receiver.url}/tg/hook", secret_token="s3cret", allowed_updates=["message"])
        return await bot.get_webhook_info()

    info = run_bot(server, setup)
    assert info.url == f"{receiver.url}/tg/hook"
    assert info.allowed_updates == ("message",)

    pushed = sandbox.push_message(TOKEN, 4242, "/start hello", username="alice")
    assert pushed["webhook_status"] == 200
    (got,) = receiver.received
    assert got["path"] == "/tg/hook"
    assert got["headers"]["X-Telegram-Bot-Api-Secret-Token"] == "s3cret"
    update = telegram.Update.de_json(got["update"], None)
    assert update.message is not None
    assert update.message.text == "/start hello"
    assert update.message.chat.id == 4242
    assert update.message.from_user.username == "alice"
    assert update.message.entities[0].type == "bot_command"
    assert got["update"] == pushed["update"]

    # Same update twice = Telegram redelivering after a lost acknowledgement.
    sandbox.push_update(TOKEN, pushed["update"])
    assert receiver.received[1]["update"]["update_id"] == pushed["update"]["update_id"]
    nxt = sandbox.push_message(TOKEN, 4242, "next")
    assert nxt["update"]["update_id"] == pushed["update"]["update_id"] + 1

    async def conflict(bot: telegram.Bot) -> None:
        with pytest.raises(Conflict):
            await bot.get_updates()
        await bot.delete_webhook()

    run_bot(server, conflict)
    assert sandbox.push_message(TOKEN, 4242, "queued now")["queued"] is True


def test_webhook_base_rewrites_delivery_and_errors_are_reported(
    receiver: WebhookReceiver,
) -> None:
    with SandboxServer(port=0, webhook_base=receiver.url) as srv:
        run_bot(srv, lambda bot: bot.set_webhook("https://bots.example.com/tg/hook?x=1"))
        with SandboxClient(srv.base_url) as client:
            assert client.push_message(TOKEN, 1, "hi")["webhook_status"] == 200
            assert receiver.received[0]["path"] == "/tg/hook?x=1"
            receiver.status = 500
            failed = client.push_message(TOKEN, 1, "again")
            assert failed["webhook_status"] == 500
            assert "webhook_error" in failed
        info = run_bot(srv, lambda bot: bot.get_webhook_info())
        assert info.last_error_message
        assert "500" in info.last_error_message


def test_get_updates_long_poll_and_offset(server: SandboxServer, sandbox: SandboxClient) -> None:
    sandbox.push_message(TOKEN, 31, "first")
    sandbox.push_message(TOKEN, 31, "second")
    sandbox.push_callback(TOKEN, 31, "vote:yes", message_id=1)

    async def body(bot: telegram.Bot) -> tuple[float, tuple[telegram.Update, ...]]:
        updates = await bot.get_updates(timeout=0)
        assert [u.message.text for u in updates[:2] if u.message] == ["first", "second"]
        assert updates[2].callback_query is not None
        assert updates[2].callback_query.data == "vote:yes"
        # Without an offset they are returned again; a higher offset confirms them.
        assert len(await bot.get_updates(timeout=0)) == 3
        last = updates[-1].update_id
        assert await bot.get_updates(offset=last + 1, timeout=0) == ()

        def push_later() -> None:
            time.sleep(0.3)
            with SandboxClient(server.base_url) as client:
                client.push_message(TOKEN, 31, "late")

        threading.Thread(target=push_later, daemon=True).start()
        started = time.monotonic()
        late = await bot.get_updates(offset=last + 1, timeout=5)
        return time.monotonic() - started, late

    elapsed, late = run_bot(server, body)
    assert 0.2 < elapsed < 3
    assert [u.message.text for u in late if u.message] == ["late"]
    polls = sandbox.calls(method="getUpdates")
    assert polls[-1]["params"]["timeout"] == 5
    assert polls[-1]["delivered"] is True


def test_reset_and_wait_for_calls(server: SandboxServer, sandbox: SandboxClient) -> None:
    sandbox.fault("403", method="getMe", token=TOKEN)
    sandbox.limits(per_bot_per_second=1)
    sandbox.push_message(TOKEN, 1, "pending")
    run_bot(server, lambda bot: bot.set_webhook("http://127.0.0.1:9/hook"), token=OTHER_TOKEN)

    def send_later() -> None:
        time.sleep(0.2)
        httpx.post(f"{server.bot_api_url}{TOKEN}/sendMessage", json={"chat_id": 2, "text": "hi"})

    threading.Thread(target=send_later, daemon=True).start()
    (call,) = sandbox.wait_for_calls(1, timeout=5, method="sendMessage", chat_id=2)
    assert call["delivered"] is True
    with pytest.raises(TimeoutError):
        sandbox.wait_for_calls(2, timeout=0.2, method="sendMessage")

    sandbox.reset()
    assert sandbox.calls() == []
    assert sandbox.messages() == []
    assert sandbox.faults() == []

    async def after_reset(bot: telegram.Bot) -> tuple[tuple[telegram.Update, ...], str]:
        updates = await bot.get_updates(timeout=0)
        info = await bot.get_webhook_info()
        return updates, info.url

    assert run_bot(server, after_reset) == ((), "")  # getMe fault gone, nothing pending
    assert run_bot(server, lambda bot: _flood(bot, [1, 2])) == [None, None]  # limit gone


def test_a_stopped_sandbox_refuses_connections_and_restarts_on_its_port_with_its_calls() -> None:
    srv = SandboxServer(port=0).start()
    try:
        url = f"{srv.bot_api_url}{TOKEN}/sendMessage"
        assert httpx.post(url, json={"chat_id": 5, "text": "before"}).status_code == 200
        port = srv.port
        srv.stop()
        with pytest.raises(httpx.ConnectError):
            httpx.post(url, json={"chat_id": 5, "text": "while down"}, timeout=1)
        srv.start()
        assert srv.port == port
        assert httpx.post(url, json={"chat_id": 5, "text": "after"}).status_code == 200
        with SandboxClient(srv.base_url) as client:
            assert client.sent_texts(token=TOKEN) == ["before", "after"]
    finally:
        srv.stop()


# ------------------------------------------------------------------ process & speed
# bots.sandbox.server is the entry point from before cli.py existed; it still works.
@pytest.mark.parametrize("module", ["bots.sandbox.cli", "bots.sandbox.server"])
def test_module_entry_point_starts_and_stops_on_sigterm(module: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("Bot API sandbox listening on http://127.0.0.1:")
        assert httpx.get(f"{line.rsplit(' ', 1)[1]}/sandbox/health").json() == {"ok": True}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_throughput_report(server: SandboxServer, sandbox: SandboxClient, capsys: pytest.CaptureFixture[str]) -> None:
    n = 1500
    url = f"{server.bot_api_url}{TOKEN}/sendMessage"
    with httpx.Client() as http:  # one keep-alive connection
        http.post(url, json={"chat_id": 1, "text": "warm-up"})
        started = time.perf_counter()
        for i in range(n):
            http.post(url, json={"chat_id": 1, "text": f"bench {i}"})
        httpx_rate = n / (time.perf_counter() - started)

    async def ptb(bot: telegram.Bot) -> float:
        started = time.perf_counter()
        for i in range(300):
            await bot.send_message(1, f"ptb {i}")
        return 300 / (time.perf_counter() - started)

    ptb_rate = run_bot(server, ptb)
    assert len(sandbox.messages(chat_id=1)) == n + 1 + 300
    with capsys.disabled():
        print(
            f"\n[sandbox throughput] httpx keep-alive: {httpx_rate:,.0f} sendMessage/s; "
            f"python-telegram-bot: {ptb_rate:,.0f} sendMessage/s"
        )


def test_a_user_s_photo_can_be_got_and_downloaded(server: SandboxServer, sandbox: SandboxClient) -> None:
    """A pushed photo's sizes are files: getFile names each one's path, and the file URL
    (/file/bot<token>/<path>) gives its bytes; another bot's token gets neither."""
    message = sandbox.push_message(TOKEN, 42, "", photo=True)["update"]["message"]
    assert "text" not in message
    largest = message["photo"][-1]
    answer = httpx.post(f"{server.base_url}/bot{TOKEN}/getFile", json={"file_id": largest["file_id"]}).json()
    assert answer["ok"] is True
    path = answer["result"]["file_path"]
    assert answer["result"]["file_size"] == largest["file_size"]

    download = httpx.get(f"{server.base_url}/file/bot{TOKEN}/{path}")
    assert download.status_code == 200
    assert download.content.startswith(b"sandbox photo 800x600")
    assert len(download.content) == largest["file_size"]

    refused = httpx.post(f"{server.base_url}/bot{OTHER_TOKEN}/getFile", json={"file_id": largest["file_id"]})
    assert (refused.status_code, refused.json()["description"]) == (400, "Bad Request: invalid file_id")
    assert httpx.get(f"{server.base_url}/file/bot{OTHER_TOKEN}/{path}").status_code == 404


def test_a_reset_can_continue_a_bots_update_and_message_ids(sandbox: SandboxClient) -> None:
    """A new sandbox for a bot that stored what an earlier one gave (the demo run again):
    Telegram's update ids and a chat's message ids keep increasing, so must the sandbox's."""
    sandbox.reset(continue_after={TOKEN: {"update_id": 41, "message_ids": {"7": 9}}})

    first = sandbox.push_message(TOKEN, 7, "again")["update"]
    other_chat = sandbox.push_message(TOKEN, 8, "new chat")["update"]

    assert (first["update_id"], first["message"]["message_id"]) == (42, 10)
    assert (other_chat["update_id"], other_chat["message"]["message_id"]) == (43, 1)
    with pytest.raises(SandboxControlError, match="update_id must be an integer"):
        sandbox.reset(continue_after={TOKEN: {"update_id": "many"}})
    sandbox.reset()
    assert sandbox.push_message(TOKEN, 7, "over")["update"]["update_id"] == 1
