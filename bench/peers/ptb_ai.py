"""python-telegram-bot as an AI bot, the in-memory peer of bench/ai_crowd.py: its own webhook
server (`Application.run_webhook`, tornado), `concurrent_updates` handlers each asking the
OpenAI-compatible model at `--model-url` (one shared `httpx.AsyncClient`) and answering with
its text, and `AIORateLimiter` pacing the sends at the Bot API's limits (it waits out a 429).
Nothing is stored: a crash loses every question in flight.

    .venv/bin/python bench/peers/ptb_ai.py --port 8443 --api-base-url http://127.0.0.1:8081 \\
        --token 123:abc --secret s3cret --model-url http://127.0.0.1:8090/v1

Needs tornado and aiolimiter (python-telegram-bot's [webhooks] and [rate-limiter] extras),
pinned in requirements-dev.txt.
"""

from __future__ import annotations

import argparse
import logging

import httpx
from ptb_echo import serve  # this script's folder is on sys.path
from telegram import Update
from telegram.ext import AIORateLimiter, Application, ContextTypes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-base-url", required=True, help="Bot API root, e.g. the sandbox's")
    parser.add_argument("--token", required=True)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--model-url", required=True, help="the chat-completions root (OPENAI_BASE_URL)")
    parser.add_argument("--path", default="ptb-ai")
    parser.add_argument("--concurrent-updates", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = httpx.AsyncClient(
        timeout=60, limits=httpx.Limits(max_connections=args.concurrent_updates, max_keepalive_connections=256)
    )

    async def answer(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.effective_message
        if message is None or message.text is None:
            return
        response = await model.post(
            f"{args.model_url.rstrip('/')}/chat/completions",
            json={"model": "bench", "messages": [{"role": "user", "content": message.text}]},
        )
        text = response.json()["choices"][0]["message"]["content"]
        await context.bot.send_message(chat_id=message.chat_id, text=text)

    base = args.api_base_url.rstrip("/")
    application = (
        Application.builder()
        .token(args.token)
        .base_url(f"{base}/bot")
        .base_file_url(f"{base}/file/bot")
        .concurrent_updates(args.concurrent_updates)
        .rate_limiter(AIORateLimiter(max_retries=5))
        .connection_pool_size(64)
        .build()
    )
    serve(application, answer, args)


if __name__ == "__main__":
    main()
