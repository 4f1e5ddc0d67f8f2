"""The Bot API calls of a handling, answered as Telegram would and journaled.

Each call a handler makes gets the next ordinal of its handling, and its journal row
(HandlerCall) is written before the call goes out. A message-like call goes through the
outbox, a read is called live, any other call through the effect ledger; getUpdates,
setWebhook, deleteWebhook, logOut and close are refused.

A re-run is answered from the journal; a call that differs from the journal's at its place
stops the run (`NotDeterministic`); a call that cannot be answered now defers it
(`Suspended`, no attempt spent). The reference, call by call: docs/PTB.md.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import telegram
from django.db import transaction
from django.utils import timezone
from telegram.request import RequestData

from bots.models import Bot, InboundUpdate
from bots.ptb.models import CallKind, HandlerCall
from bots.ptb.persistence import Snapshot
from core.failpoints import failpoint
from outbox import botapi
from outbox.models import ErrorClass, OutboundMessage, State
from outbox.selectors import FULL_RESULT_KEY_PREFIX, SUPPORTED_METHODS
from outbox.services import (
    EffectAmbiguous,
    EffectInProgress,
    effect,
    outbound_messages_holding,
    outbound_messages_send_held,
)

logger = logging.getLogger(__name__)

# Calls that would fight Dovecote's own delivery of the bot's updates.
REFUSED_METHODS = frozenset({"getUpdates", "setWebhook", "deleteWebhook", "logOut", "close"})
# Outbox methods a handler's call takes through the effect ledger instead: a callback answer
# has no chat to queue behind.
EFFECT_METHODS = frozenset({"answerCallbackQuery"})
# The parameters that say whom a call concerns: the journal's target.
TARGET_FIELDS = (
    "chat_id",
    "message_id",
    "message_ids",
    "from_chat_id",
    "user_id",
    "callback_query_id",
    "inline_query_id",
    "inline_message_id",
    "file_id",
    "shipping_query_id",
    "pre_checkout_query_id",
)
# How soon a suspended run looks again at what it waits for.
WAIT_FOR_SEND_SECONDS = 0.5
WAIT_FOR_DECISION_SECONDS = 2.0
WAIT_AFTER_FAILURE_SECONDS = 2.0


class Suspended(BaseException):
    """The run must wait for a call's answer: defer it (no attempt spent) until `until`.
    A BaseException, so that python-telegram-bot's handlers and error handlers cannot catch it."""

    def __init__(self, until: datetime, reason: str) -> None:
        super().__init__(reason)
        self.until, self.reason = until, reason


class NotDeterministic(BaseException):
    """A re-run made another call than the journal's at the same place: the run stops."""


class Answer:
    """What the request class hands back to python-telegram-bot: an HTTP status and body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status, self.body = status, body

    @classmethod
    def ok(cls, result: Any) -> Answer:
        return cls(200, {"ok": True, "result": result})

    @classmethod
    def error(cls, error: dict[str, Any]) -> Answer:
        return cls(int(error.get("error_code") or 400), {"ok": False, **error})

    def encoded(self) -> tuple[int, bytes]:
        return self.status, json.dumps(self.body).encode()


def telegram_error(code: int, description: str, **parameters: Any) -> dict[str, Any]:
    error: dict[str, Any] = {"error_code": code, "description": description}
    if parameters:
        error["parameters"] = parameters
    return error


def call_kind(method: str, params: dict[str, Any], *, has_files: bool) -> str:
    if method in REFUSED_METHODS:
        return CallKind.REFUSED
    if method.startswith("get"):
        return CallKind.READ
    chat_id = params.get("chat_id")
    if (
        method in SUPPORTED_METHODS
        and method not in EFFECT_METHODS
        and isinstance(chat_id, int)
        and not isinstance(chat_id, bool)
        and "inline_message_id" not in params
        and not has_files
    ):
        return CallKind.OUTBOX
    return CallKind.EFFECT


def call_target(params: dict[str, Any]) -> str:
    return ",".join(f"{name}={params[name]}" for name in TARGET_FIELDS if name in params)[:200]


def journal_key(update: InboundUpdate, consumer: str, ordinal: int) -> str:
    """The outbox key of a handling's message-like call: stable across re-runs."""
    return f"{FULL_RESULT_KEY_PREFIX}{update.update_id}:{consumer}:{ordinal}"


def effect_key(update: InboundUpdate, consumer: str, ordinal: int) -> str:
    return f"call:{update.bot_id}:{update.update_id}:{consumer}:{ordinal}"


@dataclass
class Handling:
    """One run's handling of one update: its journal and the next call's ordinal."""

    update: InboundUpdate
    consumer: str
    trace_id: str
    journal: dict[int, HandlerCall] = field(default_factory=dict)
    next_ordinal: int = 0
    errors: list[BaseException] = field(default_factory=list)
    snapshot: Snapshot | None = None

    @property
    def bot(self) -> Bot:
        return self.update.bot

    @classmethod
    def start(
        cls, *, update: InboundUpdate, consumer: str, trace_id: str, snapshot: Snapshot | None = None
    ) -> Handling:
        rows = HandlerCall.objects.filter(update=update, consumer=consumer)
        return cls(
            update=update,
            consumer=consumer,
            trace_id=trace_id,
            journal={r.ordinal: r for r in rows},
            snapshot=snapshot,
        )

    def answer(self, method: str, params: dict[str, Any], *, upload: RequestData | None = None) -> Answer:
        """Telegram's answer to the handling's next call. `upload`: the call's request data
        when it sends files (then `params` has the rest of it)."""
        ordinal = self.next_ordinal
        self.next_ordinal += 1
        kind = call_kind(method, params, has_files=upload is not None)
        target = call_target(params)
        row = self.journal.get(ordinal)
        if row is not None and (row.method, row.target) != (method, target):
            raise NotDeterministic(
                f"handler not deterministic: call {ordinal} was {row.method} ({row.target or 'no target'}) "
                f"and is now {method} ({target or 'no target'}); nothing more is sent"
            )
        if row is not None and row.ok is not None:
            return _replayed(row)
        if kind == CallKind.OUTBOX:
            return self._outbox_call(row, ordinal, method, params, target)
        if row is None:
            row = self._journal(ordinal, method, target, kind)
        if kind == CallKind.REFUSED:
            return _record_error(
                row,
                telegram_error(400, f"Dovecote delivers this bot's updates: {method} is not available to its handlers"),
            )
        if kind == CallKind.READ:
            return self._read(row, method, params)
        return self._effect(row, ordinal, method, params, upload)

    def _journal(self, ordinal: int, method: str, target: str, kind: str, **fields: Any) -> HandlerCall:
        row = HandlerCall.objects.create(
            bot_id=self.update.bot_id,
            update=self.update,
            consumer=self.consumer,
            ordinal=ordinal,
            method=method,
            target=target,
            kind=kind,
            **fields,
        )
        self.journal[ordinal] = row
        return row

    # --- message-like calls: the outbox ---------------------------------------------------

    def _outbox_call(
        self, row: HandlerCall | None, ordinal: int, method: str, params: dict[str, Any], target: str
    ) -> Answer:
        from outbox.services import MessageRejected, outbound_message_enqueue

        if row is None:
            payload = {k: v for k, v in params.items() if k != "chat_id"}
            with outbound_messages_holding() as held:
                try:
                    with transaction.atomic():
                        message, _ = outbound_message_enqueue(
                            bot_id=self.update.bot_id,
                            chat_id=params["chat_id"],
                            method=method,
                            payload=payload,
                            idempotency_key=journal_key(self.update, self.consumer, ordinal),
                            trace_id=self.trace_id,
                            source_update_id=self.update.pk,
                            consumer=self.consumer,
                            user_id=self.update.user_id,
                        )
                        row = self._journal(ordinal, method, target, CallKind.OUTBOX, message=message)
                except MessageRejected as exc:
                    # Refused before it was written: what Telegram would have answered.
                    row = self._journal(ordinal, method, target, CallKind.OUTBOX)
                    return _record_error(row, telegram_error(400, f"Bad Request: {exc}"))
            failpoint("ptb_after_journal")
            outbound_messages_send_held(held, bots={self.update.bot_id: self.update.bot})
        elif row.message_id is not None:
            # Journaled by an earlier run and not answered yet: send it if it waits and is due.
            waiting = OutboundMessage.objects.filter(
                pk=row.message_id, state__in=[State.PENDING, State.RETRY], next_attempt_at__lte=timezone.now()
            ).exists()
            if waiting:
                outbound_messages_send_held(
                    [(row.message_id, self.update.bot_id)], bots={self.update.bot_id: self.update.bot}
                )
        return _message_outcome(row)

    # --- reads: live, recorded ------------------------------------------------------------

    def _read(self, row: HandlerCall, method: str, params: dict[str, Any]) -> Answer:
        outcome = _call_live(self.bot, method, params)
        if outcome.ok:
            return _record_ok(row, outcome.result)
        if answered_by_telegram(outcome):
            return _record_error(row, _error_of(outcome))
        raise _waiting_after(outcome, f"{method} failed ({outcome.error_class}): {outcome.description}")

    # --- other side effects: the effect ledger ---------------------------------------------

    def _effect(
        self, row: HandlerCall, ordinal: int, method: str, params: dict[str, Any], upload: RequestData | None
    ) -> Answer:
        key = effect_key(self.update, self.consumer, ordinal)
        try:
            with effect(key, trace_id=self.trace_id, not_applied=(_NotApplied,)) as handle:
                if not handle.done:
                    if upload is None:
                        outcome = _call_live(self.bot, method, params)
                    else:
                        outcome = _upload(self.bot, method, upload)
                    failpoint("ptb_after_effect_answer")
                    if outcome.ok:
                        handle.record(result={"ok": True, "result": outcome.result})
                    elif answered_by_telegram(outcome):
                        # Telegram refused it: nothing applied, and the same call gets the same
                        # answer, so the refusal is the effect's recorded outcome.
                        handle.record(result={"ok": False, "error": _error_of(outcome)})
                    elif outcome.error_class == ErrorClass.AMBIGUOUS:
                        raise _MaybeApplied(outcome.description)
                    else:
                        raise _NotApplied(outcome)
        except _NotApplied as exc:
            raise _waiting_after(exc.outcome, f"{method} was not sent: {exc.outcome.description}") from None
        except EffectInProgress as exc:
            raise Suspended(_soon(WAIT_FOR_SEND_SECONDS), str(exc)) from None
        except (EffectAmbiguous, _MaybeApplied) as exc:
            raise Suspended(_soon(WAIT_FOR_DECISION_SECONDS), f"{method}: outcome unknown ({exc})") from None
        failpoint("ptb_after_effect")  # the effect is done and recorded, its journal row not answered
        stored = handle.result if isinstance(handle.result, dict) else {}
        if stored.get("ok") is False and isinstance(stored.get("error"), dict):
            return _record_error(row, stored["error"])
        # An operator's "delivered" decision keeps no result: Telegram's answer to such a call
        # is True.
        return _record_ok(row, stored.get("result", True) if "ok" in stored else True)


def _call_live(bot: Bot, method: str, params: dict[str, Any]) -> botapi.CallOutcome:
    """One Bot API call now, through the outbox's client (its error classes)."""
    return botapi.call(token=bot.token, base_url=bot.api_base_url, method=method, params=params, bot_name=bot.name)


def _upload(bot: Bot, method: str, request_data: RequestData) -> botapi.CallOutcome:
    """A call with files, sent now as python-telegram-bot encoded it, by the outbox's client
    (its connections, its error classes)."""

    async def post() -> Any:
        client = await botapi.get_bot(bot.token, bot.api_base_url)
        return await client.request.post(url=f"{client.base_url}/{method}", request_data=request_data)

    try:
        result = botapi.run_sync(post())
    except telegram.error.TelegramError as exc:
        return botapi.classify(exc)
    except TimeoutError as exc:
        return botapi.outcome_of_lost_wait(exc)
    return botapi.CallOutcome(ok=True, result=result, http_status=200)


class _NotApplied(Exception):
    def __init__(self, outcome: botapi.CallOutcome) -> None:
        super().__init__(outcome.description)
        self.outcome = outcome


class _MaybeApplied(Exception):
    pass


_ANSWERED = frozenset({ErrorClass.PERMANENT, ErrorClass.MIGRATED})


def answered_by_telegram(outcome: botapi.CallOutcome) -> bool:
    """Telegram answered with a refusal that the same call would get again (a 400, 403, a
    migrated chat): the handler gets it. A 429, a 5xx or a lost answer is waited out."""
    return outcome.error_class in _ANSWERED and outcome.error_code is not None


def _error_of(outcome: botapi.CallOutcome) -> dict[str, Any]:
    parameters: dict[str, Any] = {}
    if outcome.migrate_to_chat_id:
        parameters["migrate_to_chat_id"] = outcome.migrate_to_chat_id
    return telegram_error(outcome.error_code or 400, outcome.description, **parameters)


def _soon(seconds: float) -> datetime:
    return timezone.now() + timedelta(seconds=seconds)


def _waiting_after(outcome: botapi.CallOutcome, reason: str) -> Suspended:
    wait = outcome.retry_after if outcome.retry_after else WAIT_AFTER_FAILURE_SECONDS
    return Suspended(_soon(wait), reason[:200])


def _replayed(row: HandlerCall) -> Answer:
    if row.ok:
        return Answer.ok(row.result)
    return Answer.error(row.error or telegram_error(400, "Bad Request"))


def _record_ok(row: HandlerCall, result: Any) -> Answer:
    now = timezone.now()
    HandlerCall.objects.filter(pk=row.pk, ok__isnull=True).update(ok=True, result=result, answered_at=now)
    row.ok, row.result, row.answered_at = True, result, now
    return Answer.ok(result)


def _record_error(row: HandlerCall, error: dict[str, Any]) -> Answer:
    now = timezone.now()
    HandlerCall.objects.filter(pk=row.pk, ok__isnull=True).update(ok=False, error=error, answered_at=now)
    row.ok, row.error, row.answered_at = False, error, now
    return Answer.error(error)


def _message_outcome(row: HandlerCall) -> Answer:
    """The journaled message's answer once the outbox has one; else the run waits for it."""
    message = OutboundMessage.objects.filter(pk=row.message_id).first() if row.message_id else None
    if message is None:
        return _record_error(row, telegram_error(400, "Bad Request: the message is gone from the outbox"))
    if message.state == State.SENT:
        return _record_ok(row, _sent_result(message))
    if message.state == State.FAILED:
        attempt = message.attempt_set.exclude(outcome="ok").order_by("-number").first()
        code = attempt.error_code if attempt is not None and attempt.error_code else 400
        description = (attempt.description if attempt is not None else "") or message.last_error
        return _record_error(row, telegram_error(code, description or "Bad Request"))
    if message.state == State.CANCELLED:
        return _record_error(row, telegram_error(400, f"Bad Request: Dovecote cancelled it: {message.cancel_reason}"))
    now = timezone.now()
    if message.state == State.UNKNOWN:
        raise Suspended(
            now + timedelta(seconds=WAIT_FOR_DECISION_SECONDS),
            f"message {message.pk}: outcome unknown, waiting for an operator's decision",
        )
    until = (message.lease_expires_at or now) if message.state == State.SENDING else message.next_attempt_at
    until = max(until, now + timedelta(seconds=WAIT_FOR_SEND_SECONDS))
    raise Suspended(until, f"message {message.pk} is {message.state}")


def _sent_result(message: OutboundMessage) -> Any:
    """Telegram's answer to a sent message: kept whole (methods.keeps_full_result); when only
    its id is known (an operator decided it was delivered), the message as far as known."""
    if message.result is not None:
        return message.result
    if message.telegram_message_id is None:
        return True
    sent_at = message.sent_at or timezone.now()
    known = {
        "message_id": message.telegram_message_id,
        "date": int(sent_at.timestamp()),
        "chat": {"id": message.chat_id, "type": "private"},
    }
    payload = message.payload if isinstance(message.payload, dict) else {}
    for name in ("text", "caption"):
        if isinstance(payload.get(name), str):
            known[name] = payload[name]
    return known


# The handling this thread is running, if any (bots/ptb/runner.py sets it).
current: ContextVar[Handling | None] = ContextVar("dovecote_ptb_handling", default=None)


def answer_call(
    bot_name: str, method: str, params: dict[str, Any], upload: RequestData | None = None
) -> tuple[int, bytes]:
    """The request class's answer to one call (run in the handling's thread). Outside a
    handling (the application's start: getMe) the call is made live, unjournaled."""
    handling = current.get()
    if handling is not None:
        return handling.answer(method, params, upload=upload).encoded()
    return live_call(bot_name, method, params).encoded()


def live_call(bot_name: str, method: str, params: dict[str, Any]) -> Answer:
    if method in REFUSED_METHODS:
        return Answer.error(telegram_error(400, f"Dovecote delivers this bot's updates: {method} is not available"))
    outcome = _call_live(Bot.objects.get(name=bot_name), method, params)
    if outcome.ok:
        return Answer.ok(outcome.result)
    return Answer.error(_error_of(outcome))
