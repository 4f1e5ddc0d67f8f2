"""Auto-reply: burst coalescing and the reply guard.

With DOVECOTE_REPLY_DEBOUNCE_SECONDS > 0 the newest message of a chat defers its run until the
chat has been quiet that long, then answers every unanswered message at once; runs of earlier
messages finish as "coalesced". The guard, ChatState.last_answered_message_id, only moves
forward, in the transaction that writes the reply: two workers cannot both answer, and a chat
never gets a second answer to a message. With 0 each message is answered at once and the guard
moves after the send (outbox.dispatch.after_sends). Why: docs/DESIGN.md."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from bots import aio, registry, transitions
from bots.models import ChatState, InboundUpdate
from bots.registry import ConsumerContext, Defer, PermanentError
from bots.responders import Conversation, Responder, get_async_responder, get_responder
from outbox.services import after_held_sends

# A first answer in a chat gathers at most this far back and this many messages.
GATHER_WINDOW = timedelta(hours=24)
GATHER_LIMIT = 50


def debounce_seconds() -> float:
    return max(0.0, float(settings.DOVECOTE_REPLY_DEBOUNCE_SECONDS or 0))


def delay_range() -> tuple[float, float] | None:
    """DOVECOTE_REPLY_DELAY_RANGE as (min, max) seconds, or None: "20,60" or [20, 60]."""
    value = settings.DOVECOTE_REPLY_DELAY_RANGE
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not value:
        return None
    bounds = [float(v) for v in value]
    low, high = (bounds[0], bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])
    return (max(0.0, min(low, high)), max(0.0, low, high))


def reply_due_at(update: InboundUpdate) -> datetime:
    """When the burst ending with this message is answered. The human-like delay is drawn
    from a generator seeded by the update, so every re-run computes the same moment."""
    wait = debounce_seconds()
    bounds = delay_range()
    if bounds:
        wait += random.Random(update.pk).uniform(*bounds)  # noqa: S311 - pacing, not crypto
    return update.received_at + timedelta(seconds=wait)


def chat_last_answered(*, bot_id: int, chat_id: int) -> int | None:
    return (
        ChatState.objects.filter(bot_id=bot_id, chat_id=chat_id)
        .values_list("last_answered_message_id", flat=True)
        .first()
    )


def chat_has_newer_message(update: InboundUpdate) -> bool:
    return InboundUpdate.objects.filter(
        bot_id=update.bot_id, chat_id=update.chat_id, update_type="message", message_id__gt=update.message_id
    ).exists()


def chat_unanswered_messages(update: InboundUpdate, *, after: int | None) -> list[InboundUpdate]:
    """The chat's messages up to this one that no answer covers yet, oldest first."""
    rows = InboundUpdate.objects.filter(
        bot_id=update.bot_id,
        chat_id=update.chat_id,
        update_type="message",
        message_id__lte=update.message_id,
        received_at__gte=update.received_at - GATHER_WINDOW,
    )
    if after is not None:
        rows = rows.filter(message_id__gt=after)
    return list(reversed(rows.order_by("-message_id")[:GATHER_LIMIT]))


def burst_key(chat_id: int, upto_message_id: int) -> str:
    """One answer per (chat, newest message covered): stable across retries and workers."""
    return f"chat:{chat_id}:auto_reply:upto:{upto_message_id}"


def auto_reply_run(ctx: ConsumerContext) -> str:
    bot = ctx.bot
    if bot.responder == "none":
        return "no-responder"
    responder = get_responder(bot.responder)
    if responder is None:
        raise PermanentError(f"unknown responder {bot.responder!r}")
    update = ctx.update
    if update.chat_id is None or update.message_id is None:
        return "no-chat"
    if debounce_seconds() <= 0:
        return _answer_at_once(ctx, responder)

    texts = burst_texts(ctx)
    if isinstance(texts, str):
        return texts
    # The slow part (a model) runs before the guard is taken and outside any transaction.
    return burst_answer_write(ctx, responder(_conversation(ctx, texts)), len(texts))


def burst_texts(ctx: ConsumerContext) -> list[str] | str:
    """The texts of the burst this run answers, or the run's outcome when it answers none
    (answered already, coalesced into a newer message's run, nothing to say); raises `Defer`
    while the burst may go on."""
    update = ctx.update
    answered = chat_last_answered(bot_id=update.bot_id, chat_id=update.chat_id)
    if answered is not None and answered >= update.message_id:
        return _covered(ctx, answered)
    if chat_has_newer_message(update):
        return "coalesced"  # the run of the chat's newest message answers for this one
    due = reply_due_at(update)
    if due > timezone.now():
        raise Defer(due, reason="waiting for the burst to end")
    pending = chat_unanswered_messages(update, after=answered)
    return [m.text for m in pending if m.text] or "no-text"


def burst_answer_write(ctx: ConsumerContext, reply: str, covered: int) -> str:
    """The burst's answer written with the chat's guard moved past it, in one transaction."""
    update = ctx.update
    with transaction.atomic():
        if not transitions.mark_chat_answered(
            bot_id=update.bot_id, chat_id=update.chat_id, upto_message_id=update.message_id
        ):
            return "coalesced"  # another worker answered these messages meanwhile
        ctx.send(chat_id=update.chat_id, payload={"text": reply}, key=burst_key(update.chat_id, update.message_id))
    return f"answered {covered}"


def _conversation(ctx: ConsumerContext, texts: list[str]) -> Conversation:
    update = ctx.update
    return Conversation(
        bot=ctx.bot, chat_id=update.chat_id, texts=texts, upto_message_id=update.message_id, trace_id=ctx.trace_id
    )


def awaits_model(update: InboundUpdate) -> bool:
    """Whether the update's bot answers through a responder that waits on the network (a
    model): its auto_reply run goes on the worker's event loop (bots/aio.py)."""
    return get_async_responder(update.bot.responder) is not None


async def auto_reply_async(ctx: ConsumerContext) -> str:
    """auto_reply on the worker's event loop: the same decisions, each database step in a
    database thread, the model awaited in between; the answer written in the chat's turn
    (`ConsumerContext.in_turn`), so that a chat's answers keep the order of its messages."""
    bot, update = ctx.bot, ctx.update
    responder = get_async_responder(bot.responder)
    if responder is None:  # the bot's responder changed since routing: the synchronous form
        return await ctx.db(auto_reply_run, ctx)
    if update.chat_id is None or update.message_id is None:
        return "no-chat"
    if debounce_seconds() <= 0:
        if not ctx.text:
            return "no-text"
        reply = await responder(_conversation(ctx, [ctx.text]))
        await ctx.in_turn()
        await ctx.areply(reply)
        # The guard, as _answer_write moves it: behind the reply, never ahead.
        await aio.gathered(_note_answered, (update.bot_id, update.chat_id, update.message_id))
        return "answered 1"
    texts = await ctx.db(burst_texts, ctx)
    if isinstance(texts, str):
        return texts
    reply = await responder(_conversation(ctx, texts))
    await ctx.in_turn()
    return await ctx.db(burst_answer_write, ctx, reply, len(texts))


def auto_reply_batch(ctxs: list[ConsumerContext]) -> list[str] | None:
    """auto_reply_run for the runs of one router's batch (one bot): with no debounce, the
    answers written in one statement and the chats' guards moved in one more, in the order
    of `_answer_at_once` (replies first, the guards once they are sent). With a debounce it
    declines (None): a run may defer, which only a run alone settles; raising it from here
    failed the whole batch, and every run ran again alone."""
    if debounce_seconds() > 0:
        return None
    if not ctxs:
        return []
    outcomes: dict[int, str] = {}
    answers: list[tuple[ConsumerContext, str]] = []
    bot = ctxs[0].bot
    responder = get_responder(bot.responder) if bot.responder != "none" else None
    for n, ctx in enumerate(ctxs):
        update = ctx.update
        if bot.responder == "none":
            outcomes[n] = "no-responder"
        elif responder is None:
            raise PermanentError(f"unknown responder {bot.responder!r}")
        elif update.chat_id is None or update.message_id is None:
            outcomes[n] = "no-chat"
        elif not ctx.text:
            outcomes[n] = "no-text"
        else:
            answers.append((ctx, _answer(ctx, responder)))
            outcomes[n] = "answered 1"
    registry.replies(answers)
    answered = [(ctx.update.chat_id, ctx.update.message_id) for ctx, _ in answers]
    after_held_sends(lambda: transitions.note_chats_answered(bot_id=bot.pk, answered=answered))
    return [outcomes[n] for n in range(len(ctxs))]


def _answer(ctx: ConsumerContext, responder: Responder) -> str:
    return responder(_conversation(ctx, [ctx.text]))


def _answer_at_once(ctx: ConsumerContext, responder: Responder) -> str:
    if not ctx.text:
        return "no-text"
    return _answer_write(ctx, _answer(ctx, responder))


def _answer_write(ctx: ConsumerContext, reply: str) -> str:
    update = ctx.update
    # The reply first, then the guard, each committed alone: a crash between them leaves the
    # guard behind, never ahead, and the run's retry finds the reply by its key. With no
    # debounce nothing reads the guard before answering, so it waits until the reply is sent
    # (a worker sending what it wrote): one statement fewer before the request.
    ctx.reply(reply)
    after_held_sends(
        lambda: transitions.note_chat_answered(
            bot_id=update.bot_id, chat_id=update.chat_id, message_id=update.message_id
        )
    )
    return "answered 1"


def _note_answered(answered: list[tuple[int, int, int]]) -> list[None]:
    """Chats' guards moved past their answered messages ((bot, chat, message) each), a
    statement per bot."""
    for bot_id in {bot_id for bot_id, _, _ in answered}:
        transitions.note_chats_answered(
            bot_id=bot_id, answered=[(chat, message) for bot, chat, message in answered if bot == bot_id]
        )
    return [None] * len(answered)


def _covered(ctx: ConsumerContext, answered: int) -> str:
    """This message is answered already: by this very run before a crash, or by a burst."""
    from outbox.models import OutboundMessage

    mine = OutboundMessage.objects.filter(
        bot_id=ctx.update.bot_id, idempotency_key=burst_key(ctx.update.chat_id, ctx.update.message_id)
    ).exists()
    return "answered" if mine else "coalesced"
