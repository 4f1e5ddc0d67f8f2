"""Consumers: how developers extend Dovecote.

A consumer is a function that processes one stored update. Register it in any installed
app's `consumers.py`, or in a module named by DOVECOTE_CONSUMER_MODULES (both imported at
start-up)::

    from bots.registry import consumer

    @consumer("greeter", update_types=["message"], chat_types=["private"])
    def greet(ctx):
        if ctx.text.startswith("/start"):
            ctx.reply("Welcome!")

Each update gets one ConsumerRun per matching consumer, retried on its own. `TransientError`
retries with backoff, `PermanentError` dead-letters, `AuthError` pauses the consumer, any other
exception counts as transient, `Defer(until)` runs it later without spending an attempt. A
consumer may be an `async def` (a model, a CRM call), run on the worker's event loop
(bots/aio.py). The reference: docs/CONSUMERS.md and docs/AWAITING.md."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from importlib import import_module
from typing import TYPE_CHECKING, Any, TypeVar

from django.utils.module_loading import autodiscover_modules

logger = logging.getLogger(__name__)

T = TypeVar("T")

if TYPE_CHECKING:
    import telegram

    from bots.models import Bot, InboundUpdate
    from outbox.models import OutboundMessage


class ConsumerError(Exception):
    error_class = "transient"


class TransientError(ConsumerError):
    """Try again later (the other side is down or slow)."""

    error_class = "transient"


class PermanentError(ConsumerError):
    """Retrying cannot help (invalid data): dead-letter at once."""

    error_class = "permanent"


class AuthError(ConsumerError):
    """The destination refuses our credentials: pause the consumer, keep its runs."""

    error_class = "auth"


class TimedOut(TransientError):
    """An awaiting run was still running at its time limit (bots/aio.py): a failed attempt."""


class Defer(Exception):
    """Run this consumer again at `until`, without spending an attempt."""

    def __init__(self, until: datetime, reason: str = "") -> None:
        super().__init__(reason or f"deferred until {until.isoformat()}")
        self.until = until
        self.reason = reason


DEFAULT_BACKOFF = (1.0, 10.0, 60.0, 300.0)

# Every update type of the Bot API, as python-telegram-bot 22.x lists them
# (telegram.constants.UpdateType; tests/bots/test_getting_updates.py keeps the two equal).
# Spelled out rather than imported: the registry is imported by every process, the
# telegram package is not needed to read it.
ALL_UPDATE_TYPES: tuple[str, ...] = (
    "message",
    "edited_message",
    "channel_post",
    "edited_channel_post",
    "business_connection",
    "business_message",
    "edited_business_message",
    "deleted_business_messages",
    "message_reaction",
    "message_reaction_count",
    "inline_query",
    "chosen_inline_result",
    "callback_query",
    "shipping_query",
    "pre_checkout_query",
    "purchased_paid_media",
    "poll",
    "poll_answer",
    "my_chat_member",
    "chat_member",
    "chat_join_request",
    "chat_boost",
    "removed_chat_boost",
    "managed_bot",
    "guest_message",
)

# Telegram's own default when allowed_updates is empty: all but these opt-in types.
_OPT_IN_UPDATE_TYPES = frozenset({"chat_member", "message_reaction", "message_reaction_count"})
TELEGRAM_DEFAULT_UPDATE_TYPES: tuple[str, ...] = tuple(t for t in ALL_UPDATE_TYPES if t not in _OPT_IN_UPDATE_TYPES)


@dataclass(frozen=True)
class ConsumerSpec:
    name: str
    func: Callable[[ConsumerContext], Any]
    update_types: frozenset[str] | None = None
    chat_types: frozenset[str] | None = None
    max_attempts: int = 5
    backoff: Sequence[float] = DEFAULT_BACKOFF
    max_age: timedelta = timedelta(hours=24)
    enabled: Callable[[], bool] = field(default=lambda: True)
    timeout: float | None = None
    inline: bool | Callable[[InboundUpdate], bool] = False
    batch: Callable[[list[ConsumerContext]], Sequence[Any] | None] | None = None
    # The consumer's awaiting form, and when it is used (a callable decides per update).
    async_func: Callable[[ConsumerContext], Awaitable[Any]] | None = None
    awaits: bool | Callable[[InboundUpdate], bool] = False
    bot: str | None = None

    def wants(self, update: InboundUpdate) -> bool:
        if not self.enabled():
            return False
        if self.bot is not None and update.bot.name != self.bot:
            return False
        if self.update_types is not None and update.update_type not in self.update_types:
            return False
        return self.chat_types is None or update.chat_type in self.chat_types

    def runs_inline(self, update: InboundUpdate) -> bool:
        """Whether this update's run may go in the router's own task (DOVECOTE_INLINE_WORK):
        the consumer said it is cheap and synchronous for such an update."""
        return self.inline(update) if callable(self.inline) else self.inline

    def runs_async(self, update: InboundUpdate) -> bool:
        """Whether this update's run goes on the worker's event loop (bots/aio.py): never
        with DOVECOTE_ASYNC_CONCURRENCY 0 (a Celery task then waits for it)."""
        from django.conf import settings

        if self.async_func is None or settings.DOVECOTE_ASYNC_CONCURRENCY <= 0:
            return False
        return self.awaits(update) if callable(self.awaits) else self.awaits

    def time_limit(self) -> float:
        """Seconds a run may take before it is interrupted (Celery's soft time limit; an
        awaiting run's `asyncio.timeout`)."""
        from django.conf import settings

        return float(self.timeout if self.timeout is not None else settings.DOVECOTE_CONSUMER_TIMEOUT_SECONDS)

    def delay_after(self, attempt: int) -> float:
        """Pause before the next attempt (1-based attempt just failed), with jitter."""
        import random

        base = self.backoff[min(attempt, len(self.backoff)) - 1] if self.backoff else 1.0
        return base * random.uniform(0.8, 1.2)  # noqa: S311 - jitter


_registry: dict[str, ConsumerSpec] = {}


def consumer(
    name: str,
    *,
    update_types: Iterable[str] | None = None,
    chat_types: Iterable[str] | None = None,
    max_attempts: int = 5,
    backoff: Sequence[float] = DEFAULT_BACKOFF,
    max_age: timedelta = timedelta(hours=24),
    enabled: Callable[[], bool] | None = None,
    timeout: float | None = None,
    inline: bool | Callable[[InboundUpdate], bool] = False,
    batch: Callable[[list[ConsumerContext]], Sequence[Any] | None] | None = None,
    awaiting: Callable[[ConsumerContext], Awaitable[Any]] | None = None,
    awaits: bool | Callable[[InboundUpdate], bool] = True,
    bot: str | None = None,
) -> Callable[[Callable[[ConsumerContext], Any]], Callable[[ConsumerContext], Any]]:
    """Register a consumer under a stable name (the name is stored in runs and keys).

    `inline`: cheap and synchronous, so the router may run it in its own task right after
    routing. `batch`: the same work for several inline runs at once, one outcome per context
    (None: each run alone); what it wrote must be safe to write again. An `async def` consumer
    runs on the worker's event loop and cannot be `inline` nor have a `batch`. `awaiting`: a
    synchronous consumer's awaiting form, for the updates `awaits` picks. `bot`: the one bot
    whose updates it takes. Every argument: docs/CONSUMERS.md."""

    def decorator(func: Callable[[ConsumerContext], Any]) -> Callable[[ConsumerContext], Any]:
        if name in _registry and _registry[name].func is not func:
            raise ValueError(f"a consumer named {name!r} is already registered")
        async_func = awaiting
        if inspect.iscoroutinefunction(func):
            if inline or batch is not None:
                raise ValueError(f"consumer {name!r} is an async def: it cannot be inline nor have a batch")
            async_func = func
        _registry[name] = ConsumerSpec(
            name=name,
            func=func,
            update_types=frozenset(update_types) if update_types is not None else None,
            chat_types=frozenset(chat_types) if chat_types is not None else None,
            max_attempts=max_attempts,
            backoff=tuple(backoff),
            max_age=max_age,
            enabled=enabled or (lambda: True),
            timeout=timeout,
            inline=inline,
            batch=batch,
            async_func=async_func,
            awaits=awaits if async_func is not None else False,
            bot=bot,
        )
        return func

    return decorator


def registered() -> dict[str, ConsumerSpec]:
    return dict(_registry)


def get(name: str) -> ConsumerSpec | None:
    return _registry.get(name)


def unregister(name: str) -> None:
    _registry.pop(name, None)


def matching(update: InboundUpdate) -> list[ConsumerSpec]:
    return [spec for spec in _registry.values() if spec.wants(update)]


def wanted_update_types() -> list[str]:
    """Update types to ask Telegram for (setWebhook's and getUpdates' allowed_updates): the
    union of what the enabled consumers declare. A consumer that declares none (analytics)
    takes whatever the others make arrive, so it widens nothing: asking for every type on
    its behalf would store updates no consumer acts on. With no consumer declaring any,
    Telegram's own default set."""
    types: set[str] = set()
    for spec in _registry.values():
        if spec.enabled() and spec.update_types is not None:
            types |= spec.update_types
    return sorted(types or TELEGRAM_DEFAULT_UPDATE_TYPES)


def autodiscover() -> None:
    """Import every installed app's consumers.py, then the modules named by
    DOVECOTE_CONSUMER_MODULES; one that cannot be imported stops the process, naming it."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    autodiscover_modules("consumers")
    for module in settings.DOVECOTE_CONSUMER_MODULES:
        try:
            import_module(module)
        except (ImportError, ValueError, TypeError) as exc:  # no such module, a malformed name
            raise ImproperlyConfigured(
                f"DOVECOTE_CONSUMER_MODULES names {module!r}, which cannot be imported: {exc}"
            ) from exc


class ConsumerContext:
    """What a consumer gets: the stored update, its bot, and ways to act on it."""

    def __init__(self, *, update: InboundUpdate, consumer: str, trace_id: str, attempt: int) -> None:
        self.update = update
        self.consumer = consumer
        self.trace_id = trace_id
        self.attempt = attempt
        self._sent = 0
        self._turn: Awaitable[Any] | None = None  # set by bots/aio.py for an awaiting run

    @property
    def bot(self) -> Bot:
        return self.update.bot

    @property
    def text(self) -> str:
        return self.update.text

    @cached_property
    def tg_update(self) -> telegram.Update:
        """python-telegram-bot's parsed Update."""
        import telegram

        return telegram.Update.de_json(self.update.payload, bot=None)

    def idempotency_key(self, n: int | None = None) -> str:
        """Stable per (update, consumer, n): the same on every retry of this run."""
        return f"upd:{self.update.update_id}:{self.consumer}:{self._sent if n is None else n}"

    def send(
        self,
        *,
        chat_id: int,
        payload: dict[str, Any],
        method: str = "sendMessage",
        key: str | None = None,
        **options: Any,
    ) -> OutboundMessage:
        """Write an outbound message (once per key); the outbox delivers it. A text longer
        than Telegram allows is split there into several messages; the first is returned.
        A message the outbox refuses (a caption too long, ...) is a `PermanentError`:
        running the consumer again would write the same message. A retry of this run that
        writes another message under the same key (a model answers differently the second
        time) gets the first one back: the first answer is the one the chat receives."""
        return enqueue_one(
            self._enqueue_call(chat_id=chat_id, payload=payload, method=method, key=key, options=options)
        )

    def reply(self, text: str, **payload: Any) -> OutboundMessage:
        """Answer in the update's chat."""
        return self.send(**self._reply_call(text, payload))

    def _reply_call(self, text: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self.update.chat_id is None:
            raise PermanentError("this update has no chat to reply to")
        return {"chat_id": self.update.chat_id, "payload": {"text": text, **payload}}

    def _enqueue_call(
        self, *, chat_id: int, payload: dict[str, Any], method: str, key: str | None, options: dict[str, Any]
    ) -> dict[str, Any]:
        """The outbox call `send` makes, its key taken (the next of this run's, by default)."""
        key = key or self.idempotency_key()
        self._sent += 1
        return {
            "bot_id": self.update.bot_id,
            "chat_id": chat_id,
            "method": method,
            "payload": payload,
            "idempotency_key": key,
            "trace_id": self.trace_id,
            "source_update_id": self.update.pk,
            "consumer": self.consumer,
            "user_id": self.update.user_id,
            **options,
        }

    # --- for awaiting consumers (bots/aio.py) -------------------------------------------

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)`, synchronous database work, whole in one of the
        worker's database threads (a transaction it opens ends before it returns)."""
        from bots import aio

        return await aio.db(fn, *args, **kwargs)

    async def areply(self, text: str, **payload: Any) -> OutboundMessage:
        """`reply` from an awaiting consumer (written with the other runs' replies of the
        moment, in one statement)."""
        from bots import aio

        return await aio.reply(self, text, **payload)

    async def asend(self, **kwargs: Any) -> OutboundMessage:
        """`send` from an awaiting consumer."""
        return await self.db(lambda: self.send(**kwargs))

    async def in_turn(self) -> None:
        """Wait until the runs of this consumer for the chat's earlier updates, started
        before this one on this worker, have ended: call it before writing an answer, so
        that the answers of a chat go out in the order of its messages even when the later
        one's model answered first. Outside an awaiting run, at once."""
        if self._turn is not None:
            await self._turn

    def effect_key(self, operation: str) -> str:
        """One key per effect: (bot, update, consumer, operation). A retry of this run
        reuses it; a new update (a new intentional command) gets its own."""
        return f"eff:{self.update.bot_id}:{self.update.update_id}:{self.consumer}:{operation}"

    def effect(self, operation: str, fn: Callable[[Any], Any], *, reconcile: Callable[[str], Any] | None = None) -> Any:
        """Run a side effect (a CRM call, a payment...) at most once through the effect
        ledger; returns its result, or the stored one when it already happened.
        ``fn(handle)`` gets ``handle.key`` to pass on as an Idempotency-Key. Raise
        `TransientError`/`PermanentError`/`AuthError` for a refusal that certainly did not
        apply; any other exception leaves the outcome unknown and opens a case."""
        from outbox import services as outbox_services

        try:
            return outbox_services.effect_run(
                self.effect_key(operation),
                fn,
                trace_id=self.trace_id,
                reconcile=reconcile,
                not_applied=(ConsumerError,),
            )
        except outbox_services.EffectInProgress as exc:
            raise TransientError(str(exc)) from exc
        except outbox_services.EffectAmbiguous as exc:
            # Retrying cannot settle it: an operator decides on the reconciliation case.
            raise PermanentError(str(exc)) from exc


def replies(answers: Sequence[tuple[ConsumerContext, str]]) -> list[OutboundMessage]:
    """`ctx.reply(text)` for several runs' contexts, written in one go (a batch consumer's
    answers, in order): one INSERT for the lot on PostgreSQL. A message the outbox refuses
    raises PermanentError before anything is written (the batch then runs one by one, and
    only that run fails)."""
    from outbox.services import MessageRejected, outbound_messages_enqueue

    calls = [
        ctx._enqueue_call(method="sendMessage", key=None, options={}, **ctx._reply_call(text, {}))
        for ctx, text in answers
    ]
    try:
        enqueued = outbound_messages_enqueue(calls)
    except MessageRejected as exc:
        raise PermanentError(f"the outbox refused a message: {exc}") from exc
    for each in enqueued:
        if each.conflict:
            _first_stands(each.message)
    return [each.message for each in enqueued]


def enqueue_one(call: dict[str, Any]) -> OutboundMessage:
    """One outbox call of a consumer's (`ConsumerContext._enqueue_call`) written, as `send`
    says: a refusal is a PermanentError, a retry's other text under a taken key gets the first."""
    from outbox.services import IdempotencyConflict, MessageRejected, outbound_message_enqueue

    try:
        message, _ = outbound_message_enqueue(**call)
    except MessageRejected as exc:
        raise PermanentError(f"the outbox refused the message: {exc}") from exc
    except IdempotencyConflict as conflict:
        _first_stands(conflict.message)
        return conflict.message
    return message


def enqueue_many(calls: list[dict[str, Any]]) -> list[OutboundMessage | BaseException]:
    """Several consumers' outbox calls written together (one INSERT on PostgreSQL), each as
    `enqueue_one` would: when the outbox refuses one, the others are written one by one and
    only that one comes back as its PermanentError. A database error is raised for all."""
    from django.db import DatabaseError

    from outbox.services import outbound_messages_enqueue

    try:
        enqueued = outbound_messages_enqueue(calls)
    except DatabaseError:
        raise
    except Exception:  # noqa: BLE001 - a refused message: each alone, its error for its own
        results: list[OutboundMessage | BaseException] = []
        for call in calls:
            try:
                results.append(enqueue_one(call))
            except DatabaseError:
                raise
            except Exception as exc:  # noqa: BLE001 - settled for its run
                results.append(exc)
        return results
    for each in enqueued:
        if each.conflict:
            _first_stands(each.message)
    return [each.message for each in enqueued]


def _first_stands(message: OutboundMessage) -> None:
    logger.info(
        "message %s: a retry wrote another text under key %s; the first stands", message.pk, message.idempotency_key
    )
