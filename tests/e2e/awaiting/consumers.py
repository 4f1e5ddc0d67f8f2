"""`patient_model`: an `async def` consumer that asks the model (OPENAI_BASE_URL) through the
openai responder's awaiting form and replies, with a short time limit and backoff so that a
test sees every attempt: 3 attempts, 2 s each at most, 0.5 s and 1 s apart."""

from __future__ import annotations

from bots.registry import ConsumerContext, consumer
from bots.responders import Conversation, openai_async


@consumer("patient_model", update_types=["message"], max_attempts=3, backoff=(0.5, 1.0), timeout=2.0)
async def patient_model(ctx: ConsumerContext) -> str:
    answer = await openai_async(
        Conversation(bot=ctx.bot, chat_id=ctx.update.chat_id, texts=[ctx.text], trace_id=ctx.trace_id)
    )
    await ctx.areply(answer)
    return "answered"
