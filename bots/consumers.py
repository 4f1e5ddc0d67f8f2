"""Built-in consumers. A developer's own go in any app's consumers.py the same way."""

from __future__ import annotations

from bots.registry import ConsumerContext, PermanentError, consumer
from bots.responders import get_responder


@consumer("auto_reply", update_types=["message"], max_attempts=5)
def auto_reply(ctx: ConsumerContext) -> None:
    """Answer a chat's message with the bot's responder."""
    if ctx.bot.responder == "none" or not ctx.text:
        return
    responder = get_responder(ctx.bot.responder)
    if responder is None:
        raise PermanentError(f"unknown responder {ctx.bot.responder!r}")
    ctx.reply(responder(ctx.bot, [ctx.text]))
