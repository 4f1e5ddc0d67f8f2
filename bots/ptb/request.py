"""python-telegram-bot's request class for handlers run by Dovecote: every Bot API call of
the application lands in `do_request`, which answers it as Telegram would (an HTTP status
and Telegram's JSON), so python-telegram-bot builds its own objects and raises its own
errors. The answer itself is worked out in the handling's thread (bots/ptb/calls.py)."""

from __future__ import annotations

from typing import Any

import httpx
from django.conf import settings
from telegram.request import BaseRequest, RequestData

from bots.ptb import calls
from bots.ptb.loop import in_caller


class DovecoteRequest(BaseRequest):
    """Answers the calls of the application of one Dovecote bot (`bot_name`)."""

    def __init__(self, bot_name: str) -> None:
        self.bot_name = bot_name

    async def initialize(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    @property
    def read_timeout(self) -> float | None:
        return None

    async def do_request(
        self,
        url: str,
        method: str,
        request_data: RequestData | None = None,
        read_timeout: Any = None,
        write_timeout: Any = None,
        connect_timeout: Any = None,
        pool_timeout: Any = None,
    ) -> tuple[int, bytes]:
        if method == "GET":
            # A file download (File.download_*): the file's bytes, fetched live.
            return await in_caller(_download, self.bot_name, url)
        api_method = url.rsplit("/", 1)[-1]
        params = request_data.parameters if request_data is not None else {}
        # An upload keeps its request data: the files go as python-telegram-bot encoded them.
        upload = request_data if request_data is not None and request_data.contains_files else None
        return await in_caller(calls.answer_call, self.bot_name, api_method, dict(params), upload)


def _download(bot_name: str, url: str) -> tuple[int, bytes]:
    """python-telegram-bot asks for <its file URL>/file/bot<its token>/<file_path>; the file is
    fetched from the bot's own Bot API root with the bot's own token (the application's is
    whatever its code said, "TOKEN" in the examples)."""
    from bots.models import Bot
    from outbox.botapi import api_base_url

    file_path = url.split("/file/bot", 1)[-1].split("/", 1)[-1]
    bot = Bot.objects.get(name=bot_name)
    root = api_base_url(bot.api_base_url).rstrip("/")
    response = httpx.get(f"{root}/file/bot{bot.token}/{file_path}", timeout=settings.DOVECOTE_TELEGRAM_READ_TIMEOUT)
    return response.status_code, response.content
