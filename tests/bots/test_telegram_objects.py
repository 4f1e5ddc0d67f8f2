"""A consumer hands python-telegram-bot's objects (the ones `ctx.tg_update` is made of) to
`ctx.reply`: a keyboard, entities. They are stored as JSON and reach the Bot API as such."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from telegram import InlineKeyboardButton, InlineKeyboardMarkup, MessageEntity

from bots import registry
from bots.registry import ConsumerContext
from outbox.models import OutboundMessage
from tests.bots.fakes import deliver, execute, message_update, receive

KEYBOARD = {"inline_keyboard": [[{"text": "Track it", "callback_data": "track:1042"}]]}


@pytest.fixture
def menu_consumer() -> Iterator[None]:
    @registry.consumer("menu", update_types=["message"])
    def menu(ctx: ConsumerContext) -> str:
        button = InlineKeyboardButton("Track it", callback_data="track:1042")
        ctx.reply(
            "Order 1042 has shipped",
            reply_markup=InlineKeyboardMarkup([[button]]),
            entities=[MessageEntity(MessageEntity.BOLD, offset=0, length=10)],
        )
        return "menu"

    yield
    registry.unregister("menu")


@pytest.mark.django_db(transaction=True)
def test_a_keyboard_of_python_telegram_bot_objects_arrives_in_the_sandbox(menu_consumer: None, bot, sandbox) -> None:
    update = receive(bot, message_update(chat_id=7, text="/menu", message_id=1))

    assert execute(update, "menu", due_now=True) == "done"
    stored = OutboundMessage.objects.get(consumer="menu")
    assert stored.payload["reply_markup"] == KEYBOARD
    assert stored.payload["entities"] == [{"type": "bold", "offset": 0, "length": 10}]
    deliver(bot)

    [call] = [c for c in sandbox.calls(token=bot.token, method="sendMessage", chat_id=7) if "entities" in c["params"]]
    assert call["params"]["reply_markup"] == KEYBOARD
    [message] = [
        m["message"] for m in sandbox.messages(token=bot.token, chat_id=7) if "Order" in m["message"].get("text", "")
    ]
    assert message["reply_markup"] == KEYBOARD
