"""Handlers of the tests' own python-telegram-bot consumers, given to Dovecote as setup
functions (`ptb_consumer(..., setup=...)`): nothing of Dovecote in them.

PTB_TEST_BRANCH (the worker's environment) stands for what random() would do: another value
in another run."""

from __future__ import annotations

import os

from telegram import Update
from telegram.ext import Application, ContextTypes, MessageHandler, filters


def _branch() -> str:
    return os.environ.get("PTB_TEST_BRANCH", "a")


async def branching(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    """Its first call is another one in another run: a dice instead of a message."""
    if _branch() == "a":
        await update.message.reply_text("heads")
    else:
        await context.bot.send_dice(chat_id=update.effective_chat.id)
    await update.message.reply_text("and that is all")


async def varying(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    """The same calls in every run, only its text differs."""
    await update.message.reply_text(f"good morning from run {_branch()}")


async def five(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    for n in range(1, 6):
        await update.message.reply_text(f"part {n} of 5")


def add_branching(application: Application) -> None:
    application.add_handler(MessageHandler(filters.TEXT, branching))


def add_varying(application: Application) -> None:
    application.add_handler(MessageHandler(filters.TEXT, varying))


def add_five(application: Application) -> None:
    application.add_handler(MessageHandler(filters.Regex("^five$"), five))
    application.add_handler(MessageHandler(filters.TEXT, varying))


async def upload(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    """Sends a file from memory: an upload, not a file id."""
    sent = await update.message.reply_photo(photo=b"\x89PNG\r\n\x1a\n a picture drawn just now", caption="drawn")
    await update.message.reply_text(f"that was message {sent.message_id}")


def add_upload(application: Application) -> None:
    application.add_handler(MessageHandler(filters.TEXT, upload))
