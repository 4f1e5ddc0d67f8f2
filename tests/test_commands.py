"""Management commands (docs/OPERATIONS.md): add_bot, set_webhook, queue_status."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from bots.models import Bot

pytestmark = pytest.mark.django_db

TOKEN = "123456:AAcommand-test-token-abcdefghijklmnop"


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_add_bot_creates_a_bot_and_prints_its_webhook_path() -> None:
    output = run("add_bot", "shop", "--token", TOKEN, "--webhook-secret", "Abc_123-x", "--rate-limit", "50")

    assert "/webhooks/telegram/shop/" in output
    bot = Bot.objects.get(name="shop")
    assert (bot.token, bot.webhook_secret, bot.rate_limit, bot.responder) == (TOKEN, "Abc_123-x", 50, "echo")


def test_add_bot_is_idempotent_and_updates_what_is_given() -> None:
    run("add_bot", "shop", "--token", TOKEN, "--webhook-secret", "first")
    run("add_bot", "shop", "--token", TOKEN, "--responder", "none", "--api-base-url", "http://127.0.0.1:8081")

    bot = Bot.objects.get(name="shop")
    assert Bot.objects.count() == 1
    assert (bot.webhook_secret, bot.responder, bot.api_base_url) == ("first", "none", "http://127.0.0.1:8081")


def test_add_bot_names_the_bots_own_ops_chat_and_refuses_one_that_is_not_a_number() -> None:
    run("add_bot", "shop", "--token", TOKEN, "--ops-chat-id", "-1001234567890")
    assert Bot.objects.get(name="shop").ops_chat_id == -1001234567890
    with pytest.raises(CommandError, match="--ops-chat-id"):
        run("add_bot", "shop", "--token", TOKEN, "--ops-chat-id", "ops")


def test_add_bot_never_prints_the_token() -> None:
    assert TOKEN not in run("add_bot", "shop", "--token", TOKEN)


@pytest.mark.parametrize("secret", ["has space", "bad!char", "é", "x" * 257])
def test_add_bot_refuses_a_secret_telegram_would_refuse(secret: str) -> None:
    with pytest.raises(CommandError, match="webhook secret"):
        run("add_bot", "shop", "--token", TOKEN, "--webhook-secret", secret)
    assert not Bot.objects.exists()


@pytest.mark.parametrize("name", ["has space", "slash/name", ""])
def test_add_bot_refuses_a_name_that_cannot_be_a_url_part(name: str) -> None:
    with pytest.raises(CommandError):
        run("add_bot", name, "--token", TOKEN)
    assert not Bot.objects.exists()


@pytest.mark.parametrize("rate", ["0", "1001"])
def test_add_bot_refuses_a_rate_limit_out_of_range(rate: str) -> None:
    with pytest.raises(CommandError, match="rate-limit"):
        run("add_bot", "shop", "--token", TOKEN, "--rate-limit", rate)


def test_set_webhook_refuses_an_unknown_bot() -> None:
    with pytest.raises(CommandError, match="no bot named"):
        run("set_webhook", "nobody", "--url", "https://bot.example.com")


def test_set_webhook_registers_url_and_secret_with_the_bot_api(sandbox, bot_factory) -> None:
    bot = bot_factory(webhook_secret="alices-secret")

    run("set_webhook", bot.name, "--url", "https://bot.example.com/", "--drop-pending")

    (call,) = sandbox.calls(token=bot.token, method="setWebhook")
    assert call["params"]["url"] == f"https://bot.example.com/webhooks/telegram/{bot.name}/"
    assert call["params"]["secret_token"] == "alices-secret"
    assert call["params"]["drop_pending_updates"] in (True, "true", "True")
    assert "message" in call["params"]["allowed_updates"]


def test_set_webhook_reports_a_bot_api_refusal(sandbox, bot_factory) -> None:
    bot = bot_factory()
    sandbox.fault("401", token=bot.token)
    with pytest.raises(CommandError, match="setWebhook failed"):
        run("set_webhook", bot.name, "--url", "https://bot.example.com")


def test_queue_status_json_counts_by_state(bot) -> None:
    from outbox.services import outbound_message_enqueue

    outbound_message_enqueue(bot_id=bot.pk, chat_id=1, payload={"text": "a"}, idempotency_key="k1")
    outbound_message_enqueue(bot_id=bot.pk, chat_id=2, payload={"text": "b"}, idempotency_key="k2")

    status = json.loads(run("queue_status", "--json"))

    assert status["outbox"]["pending"] == 2
    assert status["outbox"]["sent"] == 0
    assert status["inbox"]["new"] == 0
    assert status["dead_letters"]["open"] == 0
    assert status["open_reconciliation_cases"] == 0
    assert status["oldest_waiting_seconds"] is not None


def test_queue_status_prints_a_table(bot) -> None:
    output = run("queue_status")
    assert "outbox" in output
    assert "pending=0" in output
    assert "open cases" in output


@pytest.mark.parametrize(
    "url", ["https://evil.example.com", "http://10.0.0.5:8081", "https://api.telegram.org.evil.example/"]
)
def test_add_bot_refuses_an_api_base_url_its_token_must_not_go_to(url: str) -> None:
    with pytest.raises(CommandError, match="DOVECOTE_BOT_API_HOSTS"):
        run("add_bot", "shop", "--token", TOKEN, "--api-base-url", url)
    assert not Bot.objects.exists()


@pytest.mark.parametrize("url", ["https://api.telegram.org", "http://localhost:8081", "http://[::1]:8081"])
def test_add_bot_accepts_telegram_and_loopback_api_base_urls(url: str) -> None:
    run("add_bot", "shop", "--token", TOKEN, "--api-base-url", url)
    assert Bot.objects.get(name="shop").api_base_url == url


def test_a_bot_whose_api_host_was_taken_off_the_list_sends_nothing_and_keeps_its_queue(sandbox, bot_factory) -> None:
    from django.test import override_settings

    from outbox.models import Circuit, CircuitState, OutboundMessage, State
    from outbox.sending.single import outbound_message_send
    from outbox.services import outbound_message_enqueue

    bot = bot_factory()  # its api_base_url is the sandbox on 127.0.0.1
    message, _ = outbound_message_enqueue(bot_id=bot.pk, chat_id=3, payload={"text": "hi"}, idempotency_key="h")
    with override_settings(
        DOVECOTE_BOT_API_HOSTS=["api.telegram.org"], TELEGRAM_API_BASE_URL="https://api.telegram.org"
    ):
        assert outbound_message_send(message.pk).status == "circuit-opened"

    assert sandbox.calls(token=bot.token) == []
    message.refresh_from_db()
    assert (message.state, message.last_error_class) == (State.RETRY, "auth")
    assert "DOVECOTE_BOT_API_HOSTS" in message.last_error
    assert Circuit.objects.get(scope=f"bot:{bot.pk}").state == CircuitState.OPEN
    assert OutboundMessage.objects.filter(pk=message.pk, state=State.RETRY).exists()


def test_add_bot_generates_a_webhook_secret_and_prints_it_once() -> None:
    import re

    first = run("add_bot", "shop", "--token", TOKEN)
    secret = Bot.objects.get(name="shop").webhook_secret

    assert re.fullmatch(r"[A-Za-z0-9_-]{40,256}", secret)
    assert f"Webhook secret (generated, shown once): {secret}" in first
    again = run("add_bot", "shop", "--token", TOKEN, "--responder", "none")
    assert secret not in again
    assert Bot.objects.get(name="shop").webhook_secret == secret


def test_set_webhook_always_sends_a_secret_even_for_a_bot_made_without_one(sandbox, bot_factory) -> None:
    bot = bot_factory()  # no secret: made by hand
    run("set_webhook", bot.name, "--url", "https://bot.example.com")

    bot.refresh_from_db()
    [call] = sandbox.calls(token=bot.token, method="setWebhook")
    assert bot.webhook_secret
    assert call["params"]["secret_token"] == bot.webhook_secret
