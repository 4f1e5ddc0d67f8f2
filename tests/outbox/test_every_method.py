"""Every Bot API method the outbox accepts goes through the outbox to the sandbox and ends
`sent` there: the sandbox answers each of them as Telegram would (it answered 13 of the 23
with 404 before), so a project can try any call it writes against it."""

from __future__ import annotations

import pytest

from outbox import methods, services
from outbox.models import DeadLetter, OutboundMessage, State
from tests.outbox.helpers import drive

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_limits")]

CHAT = 4711


@pytest.fixture
def no_limits(settings) -> None:
    settings.DOVECOTE_RATE_LIMITS_ENABLED = False


def send(bot, method: str, payload: dict) -> OutboundMessage:
    message, _ = services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=CHAT, method=method, payload=payload, idempotency_key=f"every:{method}"
    )
    result, message = drive(message.pk)
    assert message.state == State.SENT, (method, result, message.last_error)
    return message


def test_every_method_the_outbox_accepts_is_answered_by_the_sandbox(bot, sandbox) -> None:
    text = send(bot, "sendMessage", {"text": "to be edited, pinned and deleted"})
    photo = send(bot, "sendPhoto", {"photo": "AgACAgIAAxkDAAIphoto", "caption": "a caption"})
    later = {
        "sendDocument": {"document": "BQACAgIAAxkDAAIdoc", "caption": "the invoice"},
        "sendAudio": {"audio": "CQACAgIAAxkDAAIaudio"},
        "sendVideo": {"video": "BAACAgIAAxkDAAIvideo", "caption": "a clip"},
        "sendVoice": {"voice": "AwACAgIAAxkDAAIvoice"},
        "sendAnimation": {"animation": "CgACAgIAAxkDAAIgif"},
        "sendSticker": {"sticker": "CAACAgIAAxkDAAIsticker"},
        "sendLocation": {"latitude": 55.75, "longitude": 37.62},
        "sendContact": {"phone_number": "+10000000000", "first_name": "Shop"},
        "sendDice": {"emoji": "🎲"},
        "sendPoll": {"question": "Delivery or pick-up?", "options": ["delivery", "pick-up"]},
        "sendMediaGroup": {
            "media": [
                {"type": "photo", "media": "AgACAgIAAxkDAAIone", "caption": "front"},
                {"type": "photo", "media": "AgACAgIAAxkDAAItwo"},
            ]
        },
        "sendChatAction": {"action": "typing"},
        "copyMessage": {"from_chat_id": CHAT, "message_id": text.telegram_message_id},
        "forwardMessage": {"from_chat_id": CHAT, "message_id": text.telegram_message_id},
        "editMessageText": {"message_id": text.telegram_message_id, "text": "edited"},
        "editMessageReplyMarkup": {
            "message_id": text.telegram_message_id,
            "reply_markup": {"inline_keyboard": [[{"text": "ok", "callback_data": "ok"}]]},
        },
        "editMessageCaption": {"message_id": photo.telegram_message_id, "caption": "a better caption"},
        "pinChatMessage": {"message_id": text.telegram_message_id},
        "unpinChatMessage": {"message_id": text.telegram_message_id},
        "answerCallbackQuery": {"callback_query_id": "4382bfdwdsb323b2d9"},
        "deleteMessage": {"message_id": text.telegram_message_id},
    }
    assert set(later) | {"sendMessage", "sendPhoto"} == methods.SUPPORTED_METHODS
    for method, payload in later.items():
        send(bot, method, payload)

    called = [c["method"] for c in sandbox.calls(token=bot.token)]
    assert sorted(called) == sorted(methods.SUPPORTED_METHODS)
    stored = sandbox.messages(token=bot.token, chat_id=CHAT, include_deleted=True)
    original = next(m for m in stored if m["message_id"] == text.telegram_message_id)
    assert (original["message"]["text"], original["edited"], original["deleted"]) == ("edited", True, True)


def test_the_sandbox_refuses_what_telegram_would(bot, sandbox) -> None:
    for method, payload, error in [
        ("sendLocation", {"latitude": 91, "longitude": 0}, "wrong latitude"),
        ("sendPoll", {"question": "one option?", "options": ["only"]}, "2-10 options"),
        ("pinChatMessage", {"message_id": 999_999}, "message to pin not found"),
    ]:
        message, _ = services.outbound_message_enqueue(
            bot_id=bot.pk, chat_id=CHAT, method=method, payload=payload, idempotency_key=f"refused:{method}"
        )
        _, message = drive(message.pk)
        assert message.state == State.FAILED, method
        assert error in message.last_error.lower(), (method, message.last_error)


@pytest.mark.parametrize(
    "media",
    [
        None,
        [{"type": "photo", "media": "AgACAgIAAxkDAAIone"}],
        [{"type": "photo", "media": "a"}, {"type": "sticker", "media": "b"}],
        [{"type": "photo", "media": "a"}, {"type": "photo"}],
    ],
)
def test_a_media_group_the_bot_api_would_refuse_is_refused_at_enqueue(bot, media) -> None:
    with pytest.raises(services.MessageRejected):
        services.outbound_message_enqueue(
            bot_id=bot.pk, chat_id=CHAT, method="sendMediaGroup", payload={"media": media}, idempotency_key="group"
        )
    assert not OutboundMessage.objects.exists()


def test_a_payload_python_telegram_bot_cannot_send_is_a_dead_letter_not_a_crash(bot, sandbox) -> None:
    # An extra `media` string makes python-telegram-bot fail while building the request: it
    # crashed the worker after the attempt began, and the sweeper could only call it unknown.
    message, _ = services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=CHAT, method="sendPhoto", payload={"photo": "x", "media": "abc"}, idempotency_key="odd"
    )
    _, message = drive(message.pk)
    assert message.state == State.FAILED
    assert message.last_error_class == "permanent"
    assert "could not be made" in message.last_error
    assert DeadLetter.objects.filter(message=message).exists()
    assert sandbox.calls(token=bot.token) == []
