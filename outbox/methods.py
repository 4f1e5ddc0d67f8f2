"""The Bot API methods the outbox sends, and what kind of call each one is."""

from __future__ import annotations

SUPPORTED_METHODS = frozenset(
    {
        "sendMessage",
        "sendPhoto",
        "sendDocument",
        "sendVideo",
        "sendAudio",
        "sendVoice",
        "sendAnimation",
        "sendSticker",
        "sendLocation",
        "sendContact",
        "sendPoll",
        "sendDice",
        "sendChatAction",
        "sendMediaGroup",
        "editMessageText",
        "editMessageCaption",
        "editMessageReplyMarkup",
        "deleteMessage",
        "answerCallbackQuery",
        "copyMessage",
        "forwardMessage",
        "pinChatMessage",
        "unpinChatMessage",
    }
)
# Calls that are not messages: they need not wait behind a chat's messages (a callback
# answer expires within seconds, a typing indicator announces the reply queued after it),
# so they are unordered by default, and they take no slot of the chat's message limit.
NOT_A_MESSAGE = frozenset({"sendChatAction", "answerCallbackQuery"})
# Methods that put a new message in a chat, and so count against the flood limits.
CREATES_MESSAGE = frozenset(
    m for m in SUPPORTED_METHODS if m.startswith(("send", "copy", "forward")) and m not in NOT_A_MESSAGE
)


def ordered_by_default(method: str) -> bool:
    """Whether a call waits for the earlier messages of its chat unless told otherwise."""
    return method not in NOT_A_MESSAGE


# Messages whose writer replays Telegram's answer to its caller (python-telegram-bot handlers,
# bots/ptb) keep the whole answer in `result`, not only the message id; the payload purge
# blanks it with the text.
FULL_RESULT_KEY_PREFIX = "call:"


def keeps_full_result(idempotency_key: str) -> bool:
    """Whether a sent message keeps Telegram's whole answer (its writer replays it)."""
    return idempotency_key.startswith(FULL_RESULT_KEY_PREFIX)
