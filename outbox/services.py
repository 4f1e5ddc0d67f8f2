"""The outbox's public API: validate a call, enqueue a message or a broadcast, cancel,
resend, and the keys that make each of them idempotent. Sending is outbox/sending/, handing
rows to workers outbox/dispatch.py."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from core import rows
from core.ids import time_ordered_id
from core.logs import current_trace_id
from core.payloads import plain
from core.workers import worker_id
from outbox import botapi, chat_order, retention, selectors, splitting, transitions
from outbox import circuits as _circuits
from outbox import dispatch as outbox_dispatch
from outbox import effects as _effects
from outbox.dispatch import dispatch, kick_chat
from outbox.methods import SUPPORTED_METHODS, ordered_by_default
from outbox.models import OnAmbiguous, OutboundMessage, State
from outbox.sending import single as _single

logger = logging.getLogger(__name__)


class IdempotencyConflict(Exception):
    """The key was used before for another call (another chat, method or payload): a retry
    must repeat the call it retries. `message` is the message the key already names."""

    def __init__(self, message: OutboundMessage) -> None:
        super().__init__(f"idempotency key {message.idempotency_key!r} was used for a different call")
        self.message = message


class MessageRejected(ValueError):
    """The message cannot be accepted as given (bad method, chat or payload). `field` names
    the offending input, for the API's field errors."""

    def __init__(self, message: str, *, field: str = "payload") -> None:
        super().__init__(message)
        self.field = field


def call_fingerprint(method: str, chat_id: int, payload: dict[str, Any]) -> str:
    """sha256 of a call in a canonical form (key order does not matter). Every way a message
    is written (one row, a batch through orjson, the ORM) takes its fingerprint first, so a
    payload that is not JSON is refused here, the same for all of them: a value JSON has no
    form for (a datetime, a Decimal, a set, bytes; NaN or an infinity), keys of two types
    (not to be ordered), nesting past Python's stack, and strings PostgreSQL's jsonb refuses."""
    try:
        canonical = json.dumps([method, chat_id, payload], sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise MessageRejected(f"payload: {exc}") from None
    problem = _unstorable_string(canonical, payload)
    if problem:
        raise MessageRejected(f"payload: {problem}")
    return hashlib.sha256(canonical.encode()).hexdigest()


# A NUL's escape in json.dumps's text, not an escaped backslash followed by "u0000".
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _unstorable_string(canonical: str, payload: Any) -> str:
    """Why PostgreSQL's jsonb would refuse a string of `payload` (`canonical`: its call's
    JSON text, all ASCII), or "". Each check runs only when an escape in the text may be it."""
    if "\\u0000" in canonical and _NUL_ESCAPE.search(canonical):
        return "a string holds a NUL character, which PostgreSQL cannot store"
    if "\\ud" in canonical:  # a surrogate's escape: an emoji's pair, or half of one
        try:
            json.dumps(payload, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return "a string holds half of a surrogate pair, which is not Unicode text"
    return ""


def _another_call(stored: str, fingerprint: str) -> bool:
    """Whether a message stored under a key was stored for another call than `fingerprint`'s:
    the key's reuse is then a conflict, not a replay. Rows older than the check have none."""
    return bool(stored) and stored != fingerprint


def validate_call(method: str, chat_id: Any, payload: Any, *, splittable: bool = False) -> None:
    """Refuse what Telegram certainly would (lengths as Telegram counts them: UTF-16 units
    after entity parsing). `splittable`: an over-long sendMessage is split by the caller."""
    if method not in SUPPORTED_METHODS:
        raise MessageRejected(f"unsupported Bot API method {method!r}", field="method")
    if isinstance(chat_id, bool) or not isinstance(chat_id, int):
        raise MessageRejected("chat_id must be an integer", field="chat_id")
    if not -(2**63) <= chat_id < 2**63:
        raise MessageRejected("chat_id is out of range", field="chat_id")
    if not isinstance(payload, dict):
        raise MessageRejected("payload must be a JSON object")
    if "chat_id" in payload:
        raise MessageRejected("give chat_id once, outside payload")
    if method in ("sendMessage", "editMessageText"):
        text = payload.get("text")
        if not isinstance(text, str) or not text.strip():
            raise MessageRejected(f"{method} needs a non-empty text")
        if method == "editMessageText":
            why = "an edit cannot be split into several messages"
            _check_length(text, payload.get("parse_mode"), limit=splitting.TEXT_LIMIT, what="text", why=why)
        elif not splittable:
            why = "only a single message (outbound_message_enqueue) is split into parts"
            _check_length(text, payload.get("parse_mode"), limit=splitting.TEXT_LIMIT, what="text", why=why)
    if method == "sendMediaGroup":
        _check_media_group(payload.get("media"))
    _check_captions(method, payload)


def _check_media_group(media: Any) -> None:
    types = ", ".join(botapi.INPUT_MEDIA_TYPES)
    if not isinstance(media, list) or not 2 <= len(media) <= 10:
        raise MessageRejected("sendMediaGroup needs `media`: a list of 2-10 items", field="payload")
    for n, item in enumerate(media, start=1):
        if not isinstance(item, dict) or item.get("type") not in botapi.INPUT_MEDIA_TYPES:
            raise MessageRejected(f"media item {n} needs a type: {types}", field="payload")
        if not isinstance(item.get("media"), str) or not item["media"]:
            raise MessageRejected(f"media item {n} needs `media`: a file id or a URL", field="payload")


def _check_length(text: str, parse_mode: Any, *, limit: int, what: str, why: str) -> None:
    length = splitting.visible_length(text, parse_mode if isinstance(parse_mode, str) else None)
    if length > limit:
        raise MessageRejected(f"the {what} is {length} UTF-16 units long; Telegram allows {limit} and {why}")


def _check_captions(method: str, payload: dict[str, Any]) -> None:
    items = [payload]
    if method == "sendMediaGroup" and isinstance(payload.get("media"), list):
        items += [item for item in payload["media"] if isinstance(item, dict)]
    for item in items:
        caption = item.get("caption")
        if isinstance(caption, str):
            why = "a caption cannot be split"
            _check_length(caption, item.get("parse_mode"), limit=splitting.CAPTION_LIMIT, what="caption", why=why)


def _parts(method: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The payloads to store for one enqueue: one, or the parts of an over-long sendMessage."""
    if method != "sendMessage":
        return [payload]
    try:
        return splitting.split_message_payload(payload)
    except splitting.CannotSplit as exc:
        raise MessageRejected(f"the text is too long for one message: {exc}") from exc


def idempotency_key_problem(key: str) -> str:
    """Why a key cannot be used ("" when it can): 1-255 characters, none of them a control
    character (PostgreSQL's text refuses NUL; the others are invisible in the admin) or half
    of a surrogate pair (not Unicode text: no encoding can send it to PostgreSQL)."""
    if not 1 <= len(key) <= 255:
        return "an idempotency key is 1-255 characters"
    if _UNUSABLE_KEY_CHARACTER.search(key):
        return "an idempotency key has no control characters nor halves of surrogate pairs"
    return ""


# One search in C rather than a loop over the key's characters: every reply's key is checked.
_UNUSABLE_KEY_CHARACTER = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
_ON_AMBIGUOUS = frozenset(OnAmbiguous.values)  # `.values` builds its list on every read


def _validate_options(
    *, idempotency_key: str, send_at: datetime | None, expires_at: datetime | None, on_ambiguous: str
) -> None:
    problem = idempotency_key_problem(idempotency_key)
    if problem:
        raise MessageRejected(problem, field="idempotency_key")
    if on_ambiguous not in _ON_AMBIGUOUS:
        raise MessageRejected(f"on_ambiguous is one of {', '.join(OnAmbiguous.values)}", field="on_ambiguous")
    if send_at and expires_at and expires_at <= send_at:
        raise MessageRejected("expires_at must be after send_at", field="expires_at")


def outbound_message_enqueue(
    *,
    bot_id: int,
    chat_id: int,
    payload: dict[str, Any],
    idempotency_key: str,
    method: str = "sendMessage",
    trace_id: str = "",
    source_update_id: int | None = None,
    consumer: str = "",
    user_id: int | None = None,
    send_at: datetime | None = None,
    expires_at: datetime | None = None,
    on_ambiguous: str = OnAmbiguous.HOLD,
    ordered: bool | None = None,
    max_attempts: int | None = None,
) -> tuple[OutboundMessage, bool]:
    """Write a message to the outbox (once per key) and dispatch it after commit.

    Returns (message, created). The same key with the same call returns the stored message
    untouched; with another call (chat, method or payload) it raises IdempotencyConflict.

    A sendMessage longer than Telegram allows (4,096 UTF-16 units after entity parsing) is
    split (outbox/splitting.py) into ordered messages written in one transaction: the first
    keeps `idempotency_key` and is the one returned, part n gets `splitting.part_key(key, n)`.
    The same key again finds the first part and creates nothing.

    `ordered`: wait for the earlier messages of the chat; None means yes for messages and
    no for calls that are not messages (`NOT_A_MESSAGE`).
    """
    call = _prepared(
        bot_id=bot_id,
        chat_id=chat_id,
        payload=payload,
        idempotency_key=idempotency_key,
        method=method,
        trace_id=trace_id,
        source_update_id=source_update_id,
        consumer=consumer,
        user_id=user_id,
        send_at=send_at,
        expires_at=expires_at,
        on_ambiguous=on_ambiguous,
        ordered=ordered,
        max_attempts=max_attempts,
    )
    messages: list[OutboundMessage] = []
    if len(call.payloads) == 1:
        # The common case (one message) is one statement, like the webhook's insert: no
        # SELECT first, no savepoint.
        message = call.message
        if outbox_dispatch.claims_on_write(message):
            # Its writer sends it right after the commit: written claimed, no claim then.
            lease = timedelta(seconds=settings.DOVECOTE_SEND_LEASE_SECONDS)
            created = transitions.write_claimed(message, worker=worker_id(), lease=lease) is not None
        else:
            created = rows.insert_once(
                message, unique=("bot_id", "idempotency_key"), before=chat_order.write_lock([message])
            )
        if not created:
            message = OutboundMessage.objects.get(bot_id=bot_id, idempotency_key=idempotency_key)
        messages.append(message)
    else:
        message, created = _get_or_create_parts(bot_id, idempotency_key, call.defaults, call.payloads, messages)
    if not created and _another_call(message.request_fingerprint, call.fingerprint):
        raise IdempotencyConflict(message)
    if created:
        _dispatch_on_commit(messages)
    return message, created


@dataclass(frozen=True)
class Enqueued:
    """One message of `outbound_messages_enqueue`: the stored message, whether this call
    wrote it, and whether its key named another call already (the stored one stands)."""

    message: OutboundMessage
    created: bool
    conflict: bool


def outbound_messages_enqueue(calls: list[dict[str, Any]]) -> list[Enqueued]:
    """`outbound_message_enqueue` for several messages (its keyword arguments, one dict per
    message), in order: one INSERT for the lot and, when keys were taken, one
    read of their stored messages; ids follow the list, so a chat's messages go in its
    order. A call the outbox refuses raises MessageRejected before anything is written. A
    key that named another call comes back as that call's message (`conflict`), not as an
    exception: the other calls are written all the same. A text that must be split goes
    through the single path, and so do all the calls (send order is the list's)."""
    prepared = [_prepared(**call) for call in calls]
    if any(len(call.payloads) > 1 for call in prepared):
        done: list[Enqueued] = []
        for call in calls:
            try:
                done.append(Enqueued(*outbound_message_enqueue(**call), conflict=False))
            except IdempotencyConflict as conflict:
                done.append(Enqueued(conflict.message, created=False, conflict=True))
        return done
    messages = [call.message for call in prepared]
    if outbox_dispatch.claims_on_write_all(messages):
        # Their writer sends them right after the commit: written claimed, no claim then.
        lease = timedelta(seconds=settings.DOVECOTE_SEND_LEASE_SECONDS)
        transitions.write_many_claimed(messages, worker=worker_id(), lease=lease)
    else:
        # Asynchronously committed for a worker that sends them itself (a holding block): as
        # transitions.write_claimed says.
        rows.insert_many_once(
            messages,
            unique=("bot_id", "idempotency_key"),
            async_commit=outbox_dispatch.holding_now(),
            before=chat_order.write_lock(messages),
        )
    taken = [call for call in prepared if call.message.pk is None]
    stored: dict[tuple[int, str], OutboundMessage] = {}
    if taken:
        keys = Q()
        for call in taken:
            keys |= Q(bot_id=call.message.bot_id, idempotency_key=call.message.idempotency_key)
        stored = {(m.bot_id, m.idempotency_key): m for m in OutboundMessage.objects.filter(keys)}
    enqueued: list[Enqueued] = []
    for call in prepared:
        if call.message.pk is not None:
            enqueued.append(Enqueued(call.message, created=True, conflict=False))
            continue
        message = stored[(call.message.bot_id, call.message.idempotency_key)]
        conflict = _another_call(message.request_fingerprint, call.fingerprint)
        enqueued.append(Enqueued(message, created=False, conflict=conflict))
    _dispatch_on_commit([e.message for e in enqueued if e.created])
    return enqueued


@dataclass
class _Call:
    """A checked call: its first (or only) message as a row to write, and every part's payload."""

    message: OutboundMessage
    defaults: dict[str, Any]  # what the parts of a split text share
    payloads: list[dict[str, Any]]
    fingerprint: str


def _prepared(
    *,
    bot_id: int,
    chat_id: int,
    payload: dict[str, Any],
    idempotency_key: str,
    method: str = "sendMessage",
    trace_id: str = "",
    source_update_id: int | None = None,
    consumer: str = "",
    user_id: int | None = None,
    send_at: datetime | None = None,
    expires_at: datetime | None = None,
    on_ambiguous: str = OnAmbiguous.HOLD,
    ordered: bool | None = None,
    max_attempts: int | None = None,
) -> _Call:
    """A call checked and made a row (unsaved): what both enqueues write."""
    payload = plain(payload)
    validate_call(method, chat_id, payload, splittable=True)
    _validate_options(
        idempotency_key=idempotency_key, send_at=send_at, expires_at=expires_at, on_ambiguous=on_ambiguous
    )
    payloads = _parts(method, payload)
    fingerprint = call_fingerprint(method, chat_id, payload)
    now = timezone.now()
    defaults = {
        "request_fingerprint": fingerprint,
        "chat_id": chat_id,
        "method": method,
        "payload": payloads[0],
        # A call made outside any update's trace (the API, a script) starts its own.
        "trace_id": trace_id or current_trace_id.get() or time_ordered_id(),
        "source_update_id": source_update_id,
        "consumer": consumer,
        "user_id": user_id,
        "send_at": send_at,
        "expires_at": expires_at,
        "on_ambiguous": on_ambiguous,
        # The parts of one text go in order whatever the caller asked for.
        "ordered": (ordered_by_default(method) if ordered is None else ordered) or len(payloads) > 1,
        "max_attempts": max_attempts or settings.DOVECOTE_OUTBOX_MAX_ATTEMPTS,
        "next_attempt_at": max(send_at, now) if send_at else now,
    }
    message = rows.new(OutboundMessage, bot_id=bot_id, idempotency_key=idempotency_key, **defaults)
    return _Call(message, defaults, payloads, fingerprint)


def _dispatch_on_commit(messages: list[OutboundMessage]) -> None:
    """Hand the messages just written to workers once their transaction commits."""
    if not messages:
        return
    now = timezone.now()

    def dispatch_all() -> None:
        for row in messages:
            if row.state == State.SENDING:  # written claimed (transitions.write_claimed)
                outbox_dispatch.hand_claimed(row)
                continue
            dispatch(row.pk, bot_id=row.bot_id, countdown=max(0.0, (row.next_attempt_at - now).total_seconds()))

    transaction.on_commit(dispatch_all)


def _get_or_create_parts(
    bot_id: int, idempotency_key: str, defaults: dict[str, Any], payloads: list[dict[str, Any]], messages: list
) -> tuple[OutboundMessage, bool]:
    """The first part under the key and, when it is new, the other parts in the same
    transaction (appended to `messages` in send order)."""
    try:
        with transaction.atomic():
            chat_order.lock_chat(bot_id=bot_id, chat_id=defaults["chat_id"])
            message, created = OutboundMessage.objects.get_or_create(
                bot_id=bot_id, idempotency_key=idempotency_key, defaults=defaults
            )
            messages.append(message)
            if created:
                # Inserted one by one, so that ids - the chat's send order - follow the text.
                messages += [
                    OutboundMessage.objects.create(
                        bot_id=bot_id,
                        idempotency_key=splitting.part_key(idempotency_key, n),
                        **(defaults | {"payload": p}),
                    )
                    for n, p in enumerate(payloads[1:], start=2)
                ]
    except IntegrityError:
        # A concurrent insert with the same key won the race.
        first = OutboundMessage.objects.filter(bot_id=bot_id, idempotency_key=idempotency_key).first()
        if first is None:
            # Not the first key: a part's key belongs to another message.
            raise MessageRejected(
                f"the keys of this message's parts ({idempotency_key}#2, ...) are taken by other messages",
                field="idempotency_key",
            ) from None
        messages.clear()
        return first, False
    return message, created


def outbound_message_cancel(message_id: int, *, reason: str = "cancelled") -> bool:
    """Cancel a message that has not gone out. False when it is sending or already final.

    The first part of a split text takes its other parts with it (those still waiting):
    the rest of an answer whose beginning was cancelled must not go out on its own."""
    message = OutboundMessage.objects.filter(pk=message_id).first()
    if message is None:
        return False
    ok = transitions.cancel(message_id, reason=reason)
    if ok:
        for part_id in selectors.outbound_message_part_ids(message)[1:]:
            transitions.cancel(part_id, reason=f"{reason} (with the first part of its text)")
        kick_chat(message)
    return ok


def outbound_broadcast_cancel(*, bot_id: int, broadcast: str, reason: str = "cancelled") -> int:
    """Cancel every message of a broadcast that is still waiting (pending or retry), in
    batches; messages already sent or being sent are left as they are. How many were cancelled."""
    if not broadcast:
        raise ValueError("a broadcast key is required")
    total = 0
    while True:
        ids = transitions.cancel_broadcast_batch(bot_id=bot_id, broadcast=broadcast, reason=reason)
        if not ids:
            return total
        total += len(ids)
        # Broadcasts are unordered and hold no chat up; an ordered one (rare) lets its chat move on.
        for message in OutboundMessage.objects.filter(pk__in=ids, ordered=True):
            kick_chat(message)


def outbound_message_resend(message_id: int, *, from_states: list[str]) -> bool:
    """Put a failed or unknown message back in the queue with the same key, and hand it to
    its lane (a broadcast's to its bot's broadcast drain)."""
    ok = transitions.reset_for_resend(message_id, from_states=from_states)
    if ok:
        transaction.on_commit(lambda: outbox_dispatch.hand_on([message_id]))
    return ok


def api_client_add(*, name: str, bot_names: list[str], payload_access: bool = False) -> tuple[Any, str, bool]:
    """Create or update a REST API client: a user named `name` (no password, not staff) with a
    token, allowed to use exactly these bots. Returns (client, token, created). Raises
    ValueError naming an unknown bot or an unusable name."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from outbox.models import ApiClient

    if not 1 <= len(name) <= 150:
        raise ValueError("a client name is 1-150 characters")
    bots = list(selectors.bot_model().objects.filter(name__in=bot_names))
    unknown = sorted(set(bot_names) - {bot.name for bot in bots})
    if unknown:
        raise ValueError(f"unknown bot(s): {', '.join(unknown)}")
    with transaction.atomic():
        user, created = get_user_model().objects.get_or_create(username=name)
        if created:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        client, _ = ApiClient.objects.update_or_create(user=user, defaults={"payload_access": payload_access})
        client.bots.set(bots)
        token, _ = Token.objects.get_or_create(user=user)
    return client, token.key, created


@dataclass(frozen=True)
class BroadcastResult:
    message_ids: list[int]
    created: int


def client_key(*, client: str, key: str) -> str:
    """An outbox key for a key chosen by an API client: clients never collide with each
    other or with the project's own keys, and the result fits in 255 characters."""
    derived = f"api:{client}:{key}"
    if len(derived) <= 255:
        return derived
    return f"api:{client}:sha256:{hashlib.sha256(key.encode()).hexdigest()}"


def client_key_shown(stored: str, *, client: str) -> str:
    """A stored key as client `client` knows it: its own keys without the `api:<client>:`
    that `client_key` put before them (also inside its broadcasts' message keys, `bc:`); a
    key longer than fits shows as `sha256:<digest>`; anyone else's key as it is stored."""
    own = f"api:{client}:"
    if stored.startswith(own):
        return stored[len(own) :]
    if stored.startswith("bc:" + own):
        return "bc:" + stored[len(own) + 3 :]
    return stored


def broadcast_message_key(broadcast_key: str, chat_id: int) -> str:
    """The outbox key of one chat's message in a broadcast: stable, at most 255 characters."""
    key = f"bc:{broadcast_key}:{chat_id}"
    if len(key) <= 255:
        return key
    digest = hashlib.sha256(broadcast_key.encode()).hexdigest()
    return f"bc:sha256:{digest}:{chat_id}"


def broadcast_enqueue(
    *,
    bot_id: int,
    chat_ids: list[int],
    payload: dict[str, Any],
    broadcast_key: str,
    method: str = "sendMessage",
    send_at: datetime | None = None,
    expires_at: datetime | None = None,
    on_ambiguous: str = OnAmbiguous.HOLD,
    trace_id: str = "",
) -> BroadcastResult:
    """One payload to many chats: one unordered outbox message per chat, keyed by the
    broadcast key and the chat, written in one statement and sent by the bot's broadcast
    drain (the bulk lane: within the bot's rate limits, after its replies).

    Calling it again with the same key creates nothing new and wakes nothing again (but the
    messages of chats it adds); with another payload or method it raises IdempotencyConflict
    and writes nothing, as `outbound_message_enqueue` does.
    """
    if not chat_ids:
        raise MessageRejected("chat_ids must not be empty", field="chat_ids")
    payload = plain(payload)
    fingerprints: dict[int, str] = {}
    for chat_id in dict.fromkeys(chat_ids):
        validate_call(method, chat_id, payload)
        fingerprints[chat_id] = call_fingerprint(method, chat_id, payload)
    _validate_options(idempotency_key=broadcast_key, send_at=send_at, expires_at=expires_at, on_ambiguous=on_ambiguous)
    now = timezone.now()
    keys = {broadcast_message_key(broadcast_key, chat_id): chat_id for chat_id in fingerprints}
    shared = {
        "bot_id": bot_id,
        "method": method,
        "payload": payload,
        "broadcast": broadcast_key,
        "trace_id": trace_id or current_trace_id.get() or time_ordered_id(),
        "send_at": send_at,
        "expires_at": expires_at,
        "on_ambiguous": on_ambiguous,
        "ordered": False,
        "max_attempts": settings.DOVECOTE_OUTBOX_MAX_ATTEMPTS,
        "next_attempt_at": max(send_at, now) if send_at else now,
    }
    with transaction.atomic():
        written = _insert_broadcast(shared, keys, fingerprints)
        ids = dict(written)
        if len(written) < len(keys):
            # Stored before (a replay) or by a concurrent call: each must be this call, or the
            # whole call is rolled back.
            ids |= _broadcast_stored(bot_id, {k: c for k, c in keys.items() if k not in written}, fingerprints)
        if written:
            countdown = max(0.0, (send_at - now).total_seconds()) if send_at else 0.0
            new_ids = list(written.values())
            transaction.on_commit(lambda: _dispatch_broadcast(bot_id, new_ids, countdown=countdown))
    return BroadcastResult(message_ids=[ids[k] for k in keys], created=len(written))


def _insert_broadcast(shared: dict[str, Any], keys: dict[str, int], fingerprints: dict[int, str]) -> dict[str, int]:
    """Write a broadcast's messages (`shared`'s fields, one chat each), those whose key is
    free: one statement. Returns {key: id} of those written."""
    written = rows.insert_fanned_out(
        rows.new(OutboundMessage, **shared),
        unique=("bot_id", "idempotency_key"),
        varying={
            "chat_id": list(keys.values()),
            "idempotency_key": list(keys),
            "request_fingerprint": [fingerprints[chat] for chat in keys.values()],
        },
    )
    return {key: pk for pk, _, key in written}


def _dispatch_broadcast(bot_id: int, message_ids: list[int], *, countdown: float) -> None:
    """A broadcast just committed: one wake-up of its bot's broadcast drain (one task per
    message with a drain batch size of 1)."""
    if outbox_dispatch.drain_enabled():
        outbox_dispatch.wake_bulk_drain(bot_id, countdown=countdown)
        return
    for pk in message_ids:
        dispatch(pk, countdown=countdown, bulk=True)


def _broadcast_stored(bot_id: int, keys: dict[str, int], fingerprints: dict[int, str]) -> dict[str, int]:
    """The ids of a broadcast's messages stored so far, by key (`keys`: key -> chat). Raises
    IdempotencyConflict when one was stored for another call: a broadcast key reused with
    another payload or method must not send some chats the first and others the second."""
    stored = OutboundMessage.objects.filter(bot_id=bot_id, idempotency_key__in=list(keys)).values_list(
        "idempotency_key", "id", "request_fingerprint"
    )
    ids = {}
    for key, pk, fingerprint in stored:
        if _another_call(fingerprint, fingerprints[keys[key]]):
            raise IdempotencyConflict(OutboundMessage.objects.get(pk=pk))
        ids[key] = pk
    return ids


def outbound_messages_purge_payloads(*, older_than: datetime | None = None, batch_size: int = 500) -> int:
    """Blank the text, markup and captions of messages sent before `older_than` (default:
    DOVECOTE_PAYLOAD_RETENTION_DAYS ago). Metadata - chat, method, states, attempts, keys,
    Telegram's message id - stays. Returns how many messages were purged. The sweeper purges
    in budgeted batches instead (outbox/retention.py)."""
    if older_than is None:
        older_than = timezone.now() - timedelta(days=settings.DOVECOTE_PAYLOAD_RETENTION_DAYS)
    purged = 0
    while n := retention.outbound_payloads_purge_batch(older_than, size=batch_size):
        purged += n
    return purged


# --- The outbox's actions for the bots app --------------------------------------------------
# bots uses the outbox through services (actions, here), selectors (reads), models and the Bot
# API client (botapi), nothing else: the import-linter contract "bots uses the outbox through
# its surface" (pyproject.toml) checks it. Each an explicit name for an outbox function.

# A consumer's circuit: opened for an auth error (its wait returned), closed again on success.
circuit_open_for_auth = _circuits.open_for_auth
circuit_record_success = _circuits.record_success
# The replies written in a `with outbound_messages_holding() as held:` block are kept for the
# writer to send right after (`outbound_messages_send_held`); bookkeeping that may wait for
# those sends goes to `after_held_sends`.
outbound_messages_holding = outbox_dispatch.holding
outbound_messages_send_held = _single.send_held
after_held_sends = outbox_dispatch.after_sends
# The effect ledger: a side effect outside Telegram done at most once per key.
effect = _effects.effect
effect_run = _effects.effect_run
EffectInProgress = _effects.EffectInProgress
EffectAmbiguous = _effects.EffectAmbiguous
# Retention's budgeted, batched steps, which the inbox's retention tasks are built of.
RetentionStep = retention.Step
RetentionTask = retention.Task
retention_batch_size = retention.batch_size
retention_delete_step = retention.delete_step
retention_boundary_id = retention.boundary_id
retention_ledger_cutoff = retention.ledger_cutoff
retention_days_setting = retention.days_setting
retention_cutoff_not_before_ledger = retention.cutoff_not_before_ledger
