"""The outbox's HTTP layer under python-telegram-bot (outbox/telegram_http.py), against the
Bot API sandbox over HTTP: what HTTPXRequest did, it still does."""

from __future__ import annotations

import json

import pytest
from telegram import InputFile
from telegram.error import TelegramError
from telegram.request import BaseRequest, RequestData
from telegram.request._requestparameter import RequestParameter

from outbox import botapi, services, telegram_http
from outbox.models import ErrorClass, State
from outbox.sending import single
from tests.outbox.helpers import enqueue
from tests.support import free_port

pytestmark = pytest.mark.django_db


def test_a_proxy_from_the_environment_is_used_and_no_proxy_is_honoured(bot_factory, sandbox, monkeypatch) -> None:
    # A proxy nobody listens on: a request that goes through it is refused before it is sent.
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxied = bot_factory()  # a new token: a new HTTP client, which reads the environment
    message = enqueue(proxied, text="via the proxy")

    assert single.outbound_message_send(message.pk).status == "retry"
    message.refresh_from_db()
    assert (message.state, message.last_error_class) == (State.RETRY, ErrorClass.TRANSIENT)
    assert "never sent" in message.last_error
    assert sandbox.calls(token=proxied.token) == []

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    direct = bot_factory()
    message = enqueue(direct, text="around the proxy")

    assert single.outbound_message_send(message.pk).status == "sent"
    assert sandbox.sent_texts(token=direct.token) == ["around the proxy"]


def test_an_upload_goes_as_a_multipart_form_with_its_file(bot, sandbox) -> None:
    content = b"%PDF-1.4 not really a pdf\n" * 20

    async def upload() -> object:
        client = await botapi.get_bot(bot.token, bot.api_base_url)
        return await client.send_document(chat_id=4242, document=InputFile(content, filename="report.pdf"))

    sent = botapi.run_sync(upload())

    assert sent.chat.id == 4242
    (call,) = sandbox.calls(token=bot.token, method="sendDocument")
    assert call["params"]["document"]["filename"] == "report.pdf"
    assert call["params"]["document"]["size"] == len(content)


def test_a_message_goes_as_a_json_body_and_the_bot_api_reads_each_parameter_as_sent(bot, sandbox) -> None:
    keyboard = {"inline_keyboard": [[{"text": "Да ✅", "callback_data": "yes"}]]}
    text = 'Привет 👋 & = + % "quoted" \\ back\nslash'
    message, _ = services.outbound_message_enqueue(
        bot_id=bot.pk,
        chat_id=-1001234567890,
        payload={"text": text, "reply_markup": keyboard, "disable_notification": True},
        idempotency_key="json-body",
    )

    assert single.outbound_message_send(message.pk).status == "sent"

    (call,) = sandbox.calls(token=bot.token, method="sendMessage")
    assert call["params"]["chat_id"] == -1001234567890
    assert call["params"]["text"] == text
    assert call["params"]["reply_markup"] == keyboard
    assert call["params"]["disable_notification"] is True


def test_the_body_is_python_telegram_bots_json_payload_of_the_form_fields_it_would_post() -> None:
    # The Bot API reads a JSON body's string values as it reads the same form fields
    # (telegram-bot-api's HttpReader::parse_json_parameters): the two encodings are one request.
    request = RequestData(
        [RequestParameter.from_input("chat_id", 7), RequestParameter.from_input("reply_markup", {"a": [1]})]
    )

    body, headers = telegram_http._body(request)

    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == request.json_parameters == {"chat_id": "7", "reply_markup": '{"a": [1]}'}


@pytest.mark.parametrize(
    "answer",
    [
        b'{"ok":true,"result":{"message_id":7,"chat":{"id":-1001234567890},"text":"\\ud83d\\ude00 \xd0\x94"}}',
        b'{"ok":true,"result":true}',
        b'{"ok":true,"result":{"text":"\xff\xfe not UTF-8"}}',
        b'{"ok":true,"result":{"text":"a lone \\ud800"}}',
        b'{"ok":true,"result":{"n":1e400}}',
        b'{"ok":false,"error_code":429,"parameters":{"retry_after":3}}',
    ],
)
def test_an_answer_is_read_as_python_telegram_bot_reads_it(answer: bytes) -> None:
    assert telegram_http.AiohttpRequest.parse_json_payload(answer) == BaseRequest.parse_json_payload(answer)


@pytest.mark.parametrize("answer", [b"<html>502 Bad Gateway</html>", b"", b'{"ok":true,'])
def test_an_answer_that_is_not_json_is_python_telegram_bots_invalid_server_response(answer: bytes) -> None:
    with pytest.raises(TelegramError, match="Invalid server response"):
        telegram_http.AiohttpRequest.parse_json_payload(answer)


def test_calls_submitted_together_each_get_their_own_classified_outcome(bot, sandbox) -> None:
    # One hand-off to the loop starts them all; each future still answers for its own call.
    calls = [
        ("sendMessage", {"chat_id": 5101, "text": "first"}),
        ("sendMessage", {"chat_id": 5102, "text": ""}),  # the Bot API refuses an empty text
        ("sendMessage", {"chat_id": 5103, "text": "third"}),
    ]

    futures = botapi.submit_many(token=bot.token, base_url=bot.api_base_url, calls=calls, bot_name=bot.name)
    outcomes = [future.result(10) for future in futures]

    assert [o.ok for o in outcomes] == [True, False, True]
    assert (outcomes[1].error_class, outcomes[1].http_status) == (ErrorClass.PERMANENT, 400)
    assert [o.result["chat"]["id"] for o in (outcomes[0], outcomes[2])] == [5101, 5103]
    assert sorted(sandbox.sent_texts(token=bot.token)) == ["first", "third"]
    assert botapi.submit_many(token=bot.token, base_url=bot.api_base_url, calls=[]) == []
