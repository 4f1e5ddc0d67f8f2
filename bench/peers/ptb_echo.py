"""python-telegram-bot's own webhook echo bot, the in-memory peer of bench/sidebyside.py:
`Application.run_webhook` (tornado) answers 200 once the update is in its in-memory queue,
and a handler sends `Echo: <text>` back through the Bot API at `--api-base-url`. Nothing is
stored: a crash loses whatever is queued. PTB's defaults otherwise (updates handled one at a
time, as in PTB's echobot example).

    .venv/bin/python bench/peers/ptb_echo.py --port 8443 --api-base-url http://127.0.0.1:8081 \\
        --token 123:abc --secret s3cret

Needs tornado (python-telegram-bot[webhooks]), pinned in requirements-dev.txt.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from telegram import Update
from telegram.ext import Application, ContextTypes, MessageHandler, filters


async def echo(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    message = update.effective_message
    if message is None or message.text is None:
        return
    await context.bot.send_message(chat_id=message.chat_id, text=f"Echo: {message.text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-base-url", required=True, help="Bot API root, e.g. the sandbox's")
    parser.add_argument("--token", required=True)
    parser.add_argument("--secret", required=True, help="X-Telegram-Bot-Api-Secret-Token to require")
    parser.add_argument("--path", default="ptb-echo")
    parser.add_argument("--concurrent-updates", type=int, default=0, help="0: PTB's default (one at a time)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    base = args.api_base_url.rstrip("/")
    builder = Application.builder().token(args.token).base_url(f"{base}/bot").base_file_url(f"{base}/file/bot")
    if args.concurrent_updates:
        builder = builder.concurrent_updates(args.concurrent_updates)
    serve(builder.build(), echo, args)


def serve(application: Application, handler: Any, args: argparse.Namespace) -> None:
    """`handler` for text messages, then PTB's webhook server on 127.0.0.1:`args.port`/`args.path`
    with `args.secret`: run_webhook calls setWebhook on the Bot API (the sandbox records it)
    and serves until SIGINT/SIGTERM."""
    application.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, handler))
    application.run_webhook(
        listen="127.0.0.1",
        port=args.port,
        url_path=args.path,
        webhook_url=f"http://127.0.0.1:{args.port}/{args.path}",
        secret_token=args.secret,
        allowed_updates=["message"],
    )


if __name__ == "__main__":
    main()
