"""Getting updates: set_webhook and poll_updates against the Bot API sandbox over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from bots import registry
from bots.models import InboundUpdate, UpdateState
from outbox import botapi

pytestmark = pytest.mark.django_db


@pytest.fixture
def only_message_consumers() -> Iterator[None]:
    """A registry whose consumers want messages and button presses only."""
    saved = dict(registry._registry)
    registry._registry.clear()
    registry.consumer("replies", update_types=["message"])(lambda ctx: None)
    registry.consumer("buttons", update_types=["callback_query", "message"])(lambda ctx: None)
    yield
    registry._registry.clear()
    registry._registry.update(saved)


def webhook_info(bot) -> dict:
    outcome = botapi.call(token=bot.token, base_url=bot.api_base_url, method="getWebhookInfo", params={})
    assert outcome.ok, outcome.description
    return outcome.result


def test_set_webhook_sends_the_secret_and_the_update_types_the_consumers_need(
    bot_factory, sandbox, only_message_consumers: None
) -> None:
    bot = bot_factory(webhook_secret="alices-secret")
    out = StringIO()
    call_command("set_webhook", bot.name, "--url", "https://bot.example.com/", stdout=out)

    params = sandbox.calls(token=bot.token, method="setWebhook")[-1]["params"]
    assert params["url"] == f"https://bot.example.com/webhooks/telegram/{bot.name}/"
    assert params["secret_token"] == "alices-secret"
    assert params["allowed_updates"] == ["callback_query", "message"]
    assert params.get("drop_pending_updates") in (False, None)
    assert webhook_info(bot)["allowed_updates"] == ["callback_query", "message"]
    assert "callback_query, message" in out.getvalue()


def test_set_webhook_asks_only_for_what_the_consumers_declare(bot, sandbox) -> None:
    # The built-in consumers: auto_reply (and crm_webhook when configured) want messages;
    # analytics declares nothing, which means "whatever arrives", not every type there is.
    call_command("set_webhook", bot.name, "--url", "https://bot.example.com", stdout=StringIO())
    allowed = sandbox.calls(token=bot.token, method="setWebhook")[-1]["params"]["allowed_updates"]
    assert allowed == ["message"]
    assert webhook_info(bot)["allowed_updates"] == ["message"]


def test_set_webhook_asks_for_telegrams_default_when_no_consumer_declares_a_type(bot, sandbox) -> None:
    saved = dict(registry._registry)
    registry._registry.clear()
    registry.consumer("observer")(lambda ctx: None)
    try:
        call_command("set_webhook", bot.name, "--url", "https://bot.example.com", stdout=StringIO())
    finally:
        registry._registry.clear()
        registry._registry.update(saved)
    allowed = sandbox.calls(token=bot.token, method="setWebhook")[-1]["params"]["allowed_updates"]
    assert {"message", "callback_query"} <= set(allowed)
    assert not {"chat_member", "message_reaction", "message_reaction_count"} & set(allowed)


def test_the_update_types_are_the_bot_apis_as_python_telegram_bot_lists_them() -> None:
    from telegram.constants import UpdateType

    assert set(registry.ALL_UPDATE_TYPES) == {t.value for t in UpdateType}


def test_set_webhook_drop_pending_drops_the_updates_telegram_holds(bot, sandbox) -> None:
    sandbox.push_message(bot.token, chat_id=1, text="sent while nobody listened")
    assert webhook_info(bot)["pending_update_count"] == 1

    call_command("set_webhook", bot.name, "--url", "https://bot.example.com", "--drop-pending", stdout=StringIO())

    assert sandbox.calls(token=bot.token, method="setWebhook")[-1]["params"]["drop_pending_updates"] is True
    assert webhook_info(bot)["pending_update_count"] == 0


def test_poll_updates_stores_updates_through_the_inbox_and_resumes_from_the_stored_offset(bot, sandbox) -> None:
    first = sandbox.push_message(bot.token, chat_id=10, text="hello")["update"]
    second = sandbox.push_message(bot.token, chat_id=11, text="anyone?")["update"]
    assert sandbox.calls(token=bot.token, method="getUpdates") == []

    out = StringIO()
    call_command("poll_updates", bot.name, "--once", "--timeout", "0", stdout=out)

    stored = InboundUpdate.objects.filter(bot=bot).order_by("update_id")
    assert [(u.update_id, u.chat_id, u.text, u.state) for u in stored] == [
        (first["update_id"], 10, "hello", UpdateState.NEW),
        (second["update_id"], 11, "anyone?", UpdateState.NEW),
    ]
    assert len({u.trace_id for u in stored}) == 2
    bot.refresh_from_db()
    assert bot.polling_offset == second["update_id"] + 1
    assert "Stored 2 update(s)" in out.getvalue()

    # Telegram hands the first update out again (say, it never saw the offset), plus a new one.
    sandbox.push_update(bot.token, first)
    third = sandbox.push_message(bot.token, chat_id=10, text="still there?")["update"]
    call_command("poll_updates", bot.name, "--once", "--timeout", "0", stdout=StringIO())

    assert sandbox.calls(token=bot.token, method="getUpdates")[-1]["params"]["offset"] == second["update_id"] + 1
    assert InboundUpdate.objects.filter(bot=bot).count() == 3
    bot.refresh_from_db()
    assert bot.polling_offset == third["update_id"] + 1


def test_poll_updates_refuses_while_a_webhook_is_set_and_says_how_to_fix_it(bot, sandbox) -> None:
    call_command("set_webhook", bot.name, "--url", "https://bot.example.com", stdout=StringIO())

    with pytest.raises(CommandError) as refused:
        call_command("poll_updates", bot.name, "--once", "--timeout", "0", stdout=StringIO())

    assert "409" in str(refused.value)
    assert "--delete-webhook" in str(refused.value)
    assert not InboundUpdate.objects.exists()

    call_command("poll_updates", bot.name, "--once", "--timeout", "0", "--delete-webhook", stdout=StringIO())
    assert webhook_info(bot)["url"] == ""
    sandbox.push_message(bot.token, chat_id=3, text="now polling")
    call_command("poll_updates", bot.name, "--once", "--timeout", "0", stdout=StringIO())
    assert InboundUpdate.objects.get(bot=bot).text == "now polling"
