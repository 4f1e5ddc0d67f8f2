"""The Bot API client: python-telegram-bot's `Bot`, one event loop per process, and the
mapping of its exceptions to Dovecote's error classes.

Each process owns one loop, run in a daemon thread, and one initialised `Bot` per (token,
base URL); synchronous callers submit coroutines to it. Why: docs/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

# Opt in to PTB 22's future type for RetryAfter.retry_after (a timedelta); _seconds() reads
# either, and without this every 429 logs a deprecation warning.
os.environ.setdefault("PTB_TIMEDELTA", "1")

import telegram
from django.conf import settings
from telegram import error as tg_error
from telegram.warnings import PTBUserWarning

from core import metrics
from outbox import policy, telegram_http
from outbox.models import ErrorClass

logger = logging.getLogger(__name__)

T = TypeVar("T")

# do_api_request() warns when a method also exists as a Bot attribute (sendMessage does,
# as a camelCase alias). The outbox sends raw Bot API payloads on purpose.
warnings.filterwarnings("ignore", message=r"Please use 'Bot\.", category=PTBUserWarning)


@dataclass
class CallOutcome:
    """What one Bot API call came to, in the terms the outbox decides on."""

    ok: bool
    result: Any = None
    error_class: str = ""
    http_status: int | None = None
    error_code: int | None = None
    description: str = ""
    retry_after: float | None = None
    migrate_to_chat_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def telegram_message_id(self) -> int | None:
        if isinstance(self.result, dict):
            mid = self.result.get("message_id")
            return int(mid) if mid is not None else None
        return None


class _ProcessLoop:
    """An asyncio loop in a daemon thread, recreated after fork (Celery prefork children)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bots: dict[tuple[str, str], telegram.Bot] = {}

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                if self._loop is None:
                    atexit.register(self._close)
                # A forked child's inherited clients belong to the parent's loop: kept, never
                # used or finalised here (their sockets are the parent's).
                _inherited.extend(self._bots.values())
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="telegram-loop", daemon=True).start()
                self._loop, self._pid, self._bots = loop, os.getpid(), {}
            return self._loop

    def _close(self) -> None:
        """At exit: close this process's HTTP sessions on their loop (aiohttp warns about
        sessions left open)."""
        loop, bots = self._loop, list(self._bots.values())
        if loop is None or self._pid != os.getpid() or not loop.is_running() or not bots:
            return

        async def close() -> None:
            for bot in bots:
                await bot.request.shutdown()
                await bot._request[0].shutdown()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), loop).result(2)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop())
        return future.result(timeout)

    async def bot(self, token: str, base_url: str) -> telegram.Bot:
        key = (token, base_url)
        bot = self._bots.get(key)
        if bot is None:
            bot = telegram.Bot(
                token,
                base_url=f"{base_url.rstrip('/')}/bot",
                base_file_url=f"{base_url.rstrip('/')}/file/bot",
                request=_request(),
                get_updates_request=_request(read_timeout=None),
            )
            # Initialise the HTTP clients only: Bot.initialize() would also call getMe.
            await bot.request.initialize()
            await bot._request[0].initialize()
            self._bots[key] = bot
        return bot


# The HTTP status of the last answer in this task, for the attempt record (PTB's
# NetworkError for a 5xx keeps only Telegram's description).
_last_status: contextvars.ContextVar[int | None] = contextvars.ContextVar("last_status", default=None)


class _StatusRecordingRequest(telegram_http.AiohttpRequest):
    async def do_request(self, *args: Any, **kwargs: Any) -> tuple[int, bytes]:
        code, payload = await super().do_request(*args, **kwargs)
        _last_status.set(code)
        return code, payload


def _request(read_timeout: float | None = -1.0) -> telegram_http.AiohttpRequest:
    # As many connections as a process has requests in flight (a batch of sends; a single
    # send has one).
    return _StatusRecordingRequest(
        connection_pool_size=max(4, settings.DOVECOTE_DRAIN_BATCH_SIZE, policy.MAX_SEND_BATCH, policy.MAX_BULK_BATCH),
        connect_timeout=settings.DOVECOTE_TELEGRAM_CONNECT_TIMEOUT,
        read_timeout=settings.DOVECOTE_TELEGRAM_READ_TIMEOUT if read_timeout == -1.0 else read_timeout,
        pool_timeout=settings.DOVECOTE_TELEGRAM_CONNECT_TIMEOUT,
    )


_inherited: list[telegram.Bot] = []
_process_loop = _ProcessLoop()


class DisallowedApiHost(ValueError):
    """A Bot API root on a host that is not on DOVECOTE_BOT_API_HOSTS: the token, which is
    part of every request's path, must not go there."""


def api_host_allowed(url: str) -> bool:
    """Is this Bot API root on an allowed host? DOVECOTE_BOT_API_HOSTS (Telegram's host, and
    loopback with DEBUG on, by default) and the host of TELEGRAM_API_BASE_URL, which the
    operator set."""
    return _host_allowed(url, tuple(settings.DOVECOTE_BOT_API_HOSTS), settings.TELEGRAM_API_BASE_URL)


@functools.lru_cache(maxsize=256)
def _host_allowed(url: str, hosts: tuple[str, ...], base_url: str) -> bool:
    # Asked before every Bot API call (get_bot): worked out once per URL and settings.
    host = (urlsplit(url).hostname or "").lower()
    allowed = {h.lower().strip("[]") for h in hosts}
    allowed.add((urlsplit(base_url).hostname or "").lower())
    return bool(host) and host in allowed


def api_base_url(bot_api_base_url: str) -> str:
    url = bot_api_base_url or settings.TELEGRAM_API_BASE_URL
    if not api_host_allowed(url):
        raise DisallowedApiHost(f"Bot API host of {urlsplit(url).hostname!r} is not on DOVECOTE_BOT_API_HOSTS")
    return url


def _default_timeout() -> float:
    return policy.answer_wait_seconds()


def process_loop() -> asyncio.AbstractEventLoop:
    """This process's Telegram loop (bots/aio.py runs awaiting consumers and python-telegram-bot's
    handlers on it too)."""
    return _process_loop.loop()


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run a coroutine on this process's Telegram loop and wait for it."""
    return _process_loop.run(coro, _default_timeout() if timeout is None else timeout)


async def get_bot(token: str, base_url: str) -> telegram.Bot:
    """The process's initialised `telegram.Bot` for this token (call on the Telegram loop)."""
    return await _process_loop.bot(token, api_base_url(base_url))


async def _call(
    token: str, base_url: str, method: str, params: dict[str, Any], timeout: float | None, bot_name: str = ""
) -> CallOutcome:
    """One Bot API call; the one place every call of the outbox passes, so it is counted here."""
    started = time.monotonic()
    outcome = await _classified_call(token, base_url, method, params, timeout)
    metrics.BOT_API_SECONDS.labels(method=method).observe(time.monotonic() - started)
    metrics.count_send(bot_name, method, "ok" if outcome.ok else outcome.error_class)
    return outcome


# The InputMedia types a media group may hold (sendMediaGroup).
INPUT_MEDIA_TYPES = {
    "photo": telegram.InputMediaPhoto,
    "video": telegram.InputMediaVideo,
    "document": telegram.InputMediaDocument,
    "audio": telegram.InputMediaAudio,
    "animation": telegram.InputMediaAnimation,
}


def input_media(item: dict[str, Any]) -> telegram.InputMedia:
    """One stored media-group item ({"type": "photo", "media": ..., "caption": ...}) as
    python-telegram-bot's InputMedia; fields it does not name go along as they are."""
    cls = INPUT_MEDIA_TYPES[item["type"]]
    accepted = inspect.signature(cls).parameters
    fields = {k: v for k, v in item.items() if k != "type"}
    known = {k: v for k, v in fields.items() if k in accepted}
    extra = {k: v for k, v in fields.items() if k not in accepted}
    return cls(**known, api_kwargs=extra or None)


async def _classified_call(
    token: str, base_url: str, method: str, params: dict[str, Any], timeout: float | None
) -> CallOutcome:
    try:
        bot = await get_bot(token, base_url)
    except DisallowedApiHost as exc:
        # Nothing was sent. A configuration to fix: like a refused token, the bot's circuit
        # opens and its queue is kept.
        return CallOutcome(ok=False, error_class=ErrorClass.AUTH, description=str(exc))
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["read_timeout"] = timeout
    try:
        if isinstance(params.get("media"), list):
            # python-telegram-bot takes a media group as InputMedia objects, not as JSON.
            params = {**params, "media": [input_media(item) for item in params["media"]]}
        result = await bot.do_api_request(method, api_kwargs=params, **kwargs)
    except tg_error.TelegramError as exc:
        outcome = classify(exc)
        # Each call runs in its own asyncio task, so this is the status of its own answer.
        outcome.http_status = _last_status.get() or outcome.http_status
        if outcome.error_class == ErrorClass.TRANSIENT and outcome.http_status and outcome.error_code is None:
            outcome.error_code = outcome.http_status
        return outcome
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # Not a Telegram error: python-telegram-bot wraps every network failure in one; these
        # come from building the request out of the payload (nothing was sent). The same
        # payload would fail again: permanent, with the reason, instead of a worker crash
        # that the sweeper could only call `unknown`.
        logger.warning("the %s call could not be made: %r", method, exc)
        return CallOutcome(
            ok=False, error_class=ErrorClass.PERMANENT, description=f"the call could not be made: {exc!r}"[:2000]
        )
    return CallOutcome(ok=True, result=result, http_status=200)


def call(
    *,
    token: str,
    base_url: str,
    method: str,
    params: dict[str, Any],
    timeout: float | None = None,
    bot_name: str = "",
) -> CallOutcome:
    """Make one Bot API call and classify its outcome. Never raises for Telegram errors."""
    try:
        return run_sync(_call(token, base_url, method, params, timeout, bot_name))
    except TimeoutError as exc:
        return outcome_of_lost_wait(exc)


def submit_many(
    *, token: str, base_url: str, calls: list[tuple[str, dict[str, Any]]], bot_name: str = ""
) -> list[concurrent.futures.Future[CallOutcome]]:
    """Start several Bot API calls (method, params) on the process's loop and return at once:
    the batched drain has them in flight together. One hand-off to the loop starts them all
    (one wake-up of its thread, where a call each cost a wake-up each). Each future's result
    is its call's classified outcome."""
    if not calls:
        return []
    loop = _process_loop.loop()
    futures: list[concurrent.futures.Future[CallOutcome]] = [concurrent.futures.Future() for _ in calls]

    def start() -> None:
        for (method, params), future in zip(calls, futures, strict=True):
            if future.set_running_or_notify_cancel():
                task = loop.create_task(_call(token, base_url, method, params, None, bot_name))
                task.add_done_callback(functools.partial(_settle_future, future))

    loop.call_soon_threadsafe(start)
    return futures


def _settle_future(future: concurrent.futures.Future[CallOutcome], task: asyncio.Task[CallOutcome]) -> None:
    if task.cancelled():
        future.set_exception(concurrent.futures.CancelledError())
    elif (exc := task.exception()) is not None:
        future.set_exception(exc)
    else:
        future.set_result(task.result())


def send_timeout() -> float:
    """How long a caller waits for a call's outcome before calling it ambiguous."""
    return _default_timeout()


def outcome_of_lost_wait(exc: BaseException | None = None) -> CallOutcome:
    # Our own wait on the loop ran out: the request may well be on the wire.
    return CallOutcome(ok=False, error_class=ErrorClass.AMBIGUOUS, description=f"timed out waiting: {exc!r}")


_STATUS_IN_MESSAGE = re.compile(r"\((\d{3})\)\s*$")


def _seconds(value: Any) -> float:
    return value.total_seconds() if hasattr(value, "total_seconds") else float(value)


def classify(exc: BaseException) -> CallOutcome:
    """Map a python-telegram-bot exception to an error class.

    Order matters: BadRequest, Forbidden, ChatMigrated and TimedOut are all NetworkError
    subclasses, and a TimedOut or NetworkError is "never sent" or "maybe delivered"
    depending on the transport's exception underneath (outbox/telegram_http.py).
    """
    description = str(exc)
    if isinstance(exc, tg_error.RetryAfter):
        return CallOutcome(
            ok=False,
            error_class=ErrorClass.RATE_LIMITED,
            http_status=429,
            error_code=429,
            description=description,
            retry_after=_seconds(exc.retry_after),
        )
    if isinstance(exc, tg_error.ChatMigrated):
        return CallOutcome(
            ok=False,
            error_class=ErrorClass.MIGRATED,
            http_status=400,
            error_code=400,
            description=description,
            migrate_to_chat_id=int(exc.new_chat_id),
        )
    if isinstance(exc, tg_error.InvalidToken):
        return CallOutcome(
            ok=False, error_class=ErrorClass.AUTH, http_status=401, error_code=401, description=description
        )
    if isinstance(exc, tg_error.Forbidden):
        return CallOutcome(
            ok=False, error_class=ErrorClass.PERMANENT, http_status=403, error_code=403, description=description
        )
    if isinstance(exc, tg_error.BadRequest):
        # Every 400 ("message is too long", "can't parse entities", ...), even one whose body
        # was not JSON: Telegram refused this request as written, and the same request again
        # gets the same answer. A dead letter at once, never a retry.
        return CallOutcome(
            ok=False, error_class=ErrorClass.PERMANENT, http_status=400, error_code=400, description=description
        )
    if isinstance(exc, tg_error.Conflict):
        return CallOutcome(
            ok=False, error_class=ErrorClass.PERMANENT, http_status=409, error_code=409, description=description
        )
    cause = exc.__cause__
    if isinstance(exc, tg_error.TimedOut):
        # Connect and pool timeouts happen before a byte of the request is sent.
        return CallOutcome(
            ok=False,
            error_class=ErrorClass.TRANSIENT if telegram_http.never_sent(cause) else ErrorClass.AMBIGUOUS,
            description=f"{description} ({telegram_http.failure_name(cause)})",
        )
    if isinstance(exc, tg_error.NetworkError):
        if cause is None:
            # Telegram (or a proxy) answered with an error status, e.g. 502: it refused the
            # request, nothing was done.
            match = _STATUS_IN_MESSAGE.search(description)
            status = int(match.group(1)) if match else None
            return CallOutcome(ok=False, error_class=ErrorClass.TRANSIENT, http_status=status, description=description)
        if telegram_http.never_sent(cause):
            return CallOutcome(ok=False, error_class=ErrorClass.TRANSIENT, description=f"{description} (never sent)")
        # The server hung up, a reset, a broken answer...: the request may have arrived.
        name = telegram_http.failure_name(cause)
        return CallOutcome(ok=False, error_class=ErrorClass.AMBIGUOUS, description=f"{description} ({name})")
    # E.g. "Invalid server response": something answered, we cannot tell what was done.
    return CallOutcome(ok=False, error_class=ErrorClass.AMBIGUOUS, description=f"{type(exc).__name__}: {description}")
