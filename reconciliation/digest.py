"""The ops digest: new dead letters by reason, cases opened, circuits opened and closed, sent
to the operators' Telegram chat as an ordinary outbox message, by e-mail, and to any channel a
developer adds (the `ops_digest` signal or DOVECOTE_OPS_NOTIFIERS).

Counted from the rows, not from counters on the hot path. Each kind goes at most once per
DOVECOTE_OPS_DIGEST_MINUTES, claimed in Redis so two beats send one. A bot's own ops chat
(`Bot.ops_chat_id`) gets that bot's trouble alone. The ops bot never reports on itself. Why:
docs/DESIGN.md."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Count
from django.dispatch import receiver
from django.utils.module_loading import import_string

from core import connections
from outbox.circuits import bot_scope
from outbox.models import Circuit, CircuitState, DeadLetter
from reconciliation.models import ReconciliationCase
from reconciliation.signals import ops_digest

logger = logging.getLogger(__name__)

KINDS = ("dead_letters", "cases", "circuits")
BUILT_IN = {"reconciliation.digest.email", "reconciliation.digest.notifiers"}


@dataclass(frozen=True)
class Digest:
    kind: str
    counts: dict[str, int]
    text: str
    window: int  # the second its digest was claimed at
    bot_id: int | None = None  # the bot a bot's own ops chat hears about; None: every bot


def window_minutes() -> int:
    return max(1, int(settings.DOVECOTE_OPS_DIGEST_MINUTES))


def ops_bot_id() -> int | None:
    from bots.models import Bot

    name = settings.DOVECOTE_OPS_BOT
    if not name:
        return None
    return Bot.objects.filter(name=name).values_list("pk", flat=True).first()


def enabled() -> bool:
    return bool(
        (settings.DOVECOTE_OPS_BOT and settings.DOVECOTE_OPS_CHAT_ID)
        or settings.DOVECOTE_OPS_EMAILS
        or settings.DOVECOTE_OPS_NOTIFIERS
        # A developer's own receiver of `ops_digest` (beside the two built in here).
        or any(lookup[0] not in BUILT_IN for lookup, *_ in ops_digest.receivers)
    )


# --- counting ---------------------------------------------------------------------------


def count(
    kind: str, since: datetime, until: datetime, *, ops_bot: int | None, bot_id: int | None = None
) -> dict[str, int]:
    """What happened in [since, until), leaving out the ops bot's own trouble; only bot
    `bot_id`'s when given."""
    if kind == "dead_letters":
        rows = DeadLetter.objects.filter(created_at__gte=since, created_at__lt=until)
        if ops_bot is not None:
            rows = rows.exclude(bot_id=ops_bot)
        if bot_id is not None:
            rows = rows.filter(bot_id=bot_id)
        by_reason = rows.values("reason_class").annotate(n=Count("id")).order_by("-n", "reason_class")
        return {row["reason_class"]: row["n"] for row in by_reason}
    if kind == "cases":
        cases = ReconciliationCase.objects.filter(created_at__gte=since, created_at__lt=until)
        if ops_bot is not None:
            cases = cases.exclude(message__bot_id=ops_bot)
        if bot_id is not None:
            cases = cases.filter(message__bot_id=bot_id)
        n = cases.count()
        return {"opened": n} if n else {}
    if kind == "circuits":
        circuits = Circuit.objects.all()
        if ops_bot is not None:
            circuits = circuits.exclude(scope=bot_scope(ops_bot))
        if bot_id is not None:
            circuits = circuits.filter(scope=bot_scope(bot_id))
        opened = circuits.filter(opened_at__gte=since, opened_at__lt=until).exclude(state=CircuitState.CLOSED)
        closed = circuits.filter(
            state=CircuitState.CLOSED, opened_at__isnull=False, updated_at__gte=since, updated_at__lt=until
        )
        counts = {}
        for label, rows in (("opened", opened), ("closed", closed)):
            scopes = sorted(rows.values_list("scope", flat=True))
            if scopes:
                counts[label] = len(scopes)
                counts.update({f"{label} {scope}": 1 for scope in scopes})
        return counts
    raise ValueError(f"unknown digest kind {kind!r}")


def render(kind: str, counts: dict[str, int], *, minutes: int, bot: str | None = None) -> str:
    about = f" for bot {bot}" if bot else ""
    head = f"Dovecote ops digest{about} (last {minutes} min or since the previous one)"
    if kind == "dead_letters":
        total = sum(counts.values())
        lines = [f"{total} new dead letter{'s' if total != 1 else ''}:"]
        lines += [f"  {reason}: {n}" for reason, n in counts.items()]
    elif kind == "cases":
        lines = [f"{counts['opened']} reconciliation case{'s' if counts['opened'] != 1 else ''} opened"]
    else:
        lines = []
        for label in ("opened", "closed"):
            if counts.get(label):
                scopes = [k.split(" ", 1)[1] for k in counts if k.startswith(f"{label} ")]
                lines.append(f"circuits {label}: {counts[label]} ({', '.join(scopes)})")
    return "\n".join([head, *lines])


# --- the window and the cursor (Redis) --------------------------------------------------


def _key(*parts: object) -> str:
    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:ops-digest:" + ":".join(str(p) for p in parts)


def _stream(kind: str, bot_id: int | None) -> tuple[str, ...]:
    """The Redis key parts of one digest stream: a kind, for every bot or for one bot's chat."""
    return (kind,) if bot_id is None else (kind, f"bot{bot_id}")


def _since(stream: tuple[str, ...], now: datetime) -> datetime:
    value = connections.shared_redis().get(_key(*stream, "since"))
    if value is None:
        return now - timedelta(minutes=window_minutes())
    return datetime.fromtimestamp(float(value), tz=UTC)


# Claim the stream's next digest at `now` when its previous one is at least a window old: one
# step, so two sweepers (two beat instances) cannot both claim it.
_CLAIM_LUA = """
local last = redis.call('GET', KEYS[1])
if last and tonumber(ARGV[1]) < tonumber(last) + tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return 1
"""


def claim_key(kind: str, bot_id: int | None = None) -> str:
    return _key(*_stream(kind, bot_id), "last")


def _claim(kind: str, bot_id: int | None, now: datetime) -> int | None:
    """The claimed digest's second, or None while the stream's previous digest is too recent."""
    stamp = int(now.timestamp())
    seconds = window_minutes() * 60
    claimed = connections.shared_redis().eval(_CLAIM_LUA, 1, claim_key(kind, bot_id), stamp, seconds, seconds * 2)
    return stamp if claimed else None


def _advance(stream: tuple[str, ...], until: datetime) -> None:
    connections.shared_redis().set(_key(*stream, "since"), until.timestamp())


# --- sending ----------------------------------------------------------------------------


def _gather(kind: str, now: datetime, ops_bot: int | None, bot: tuple[int, str] | None = None) -> Digest | None:
    """The stream's digest if something happened since its last one and its window is free.
    Nothing new moves the stream's cursor on; a window still taken keeps the counts for the
    next digest."""
    bot_id, bot_name = bot if bot else (None, None)
    stream = _stream(kind, bot_id)
    counts = count(kind, _since(stream, now), now, ops_bot=ops_bot, bot_id=bot_id)
    if not counts:
        _advance(stream, now)
        return None
    window = _claim(kind, bot_id, now)
    if window is None:
        return None
    text = render(kind, counts, minutes=window_minutes(), bot=bot_name)
    return Digest(kind, counts, text, window, bot_id)


def flush(now: datetime) -> list[Digest]:
    """Send what each kind has gathered since its last digest, if its window is free: to the
    global channels, then to each bot's own ops chat. Called by the sweeper; never raises for
    a channel's failure."""
    from bots.models import Bot

    sent = []
    ops_bot = ops_bot_id() if settings.DOVECOTE_OPS_BOT else None
    if enabled():
        chat = int(settings.DOVECOTE_OPS_CHAT_ID) if settings.DOVECOTE_OPS_CHAT_ID else None
        for kind in KINDS:
            digest = _gather(kind, now, ops_bot)
            if digest is None:
                continue
            _to_telegram(digest, ops_bot, chat)
            ops_digest.send_robust(sender=None, kind=kind, counts=digest.counts, text=digest.text, window=digest.window)
            _advance(_stream(kind, None), now)
            sent.append(digest)
    if ops_bot is None:
        return sent
    own_chats = Bot.objects.filter(ops_chat_id__isnull=False).exclude(pk=ops_bot)
    for bot_id, name, chat in own_chats.values_list("pk", "name", "ops_chat_id"):
        for kind in KINDS:
            digest = _gather(kind, now, ops_bot, (bot_id, name))
            if digest is None:
                continue
            _to_telegram(digest, ops_bot, chat)
            _advance(_stream(kind, bot_id), now)
            sent.append(digest)
    return sent


def _to_telegram(digest: Digest, ops_bot: int | None, chat: int | None) -> None:
    if ops_bot is None or chat is None:
        if settings.DOVECOTE_OPS_BOT and ops_bot is None:
            logger.warning("ops digest: no bot named %r", settings.DOVECOTE_OPS_BOT)
        return
    from outbox.services import outbound_message_enqueue

    about = "" if digest.bot_id is None else f"bot{digest.bot_id}:"
    try:
        with transaction.atomic():
            outbound_message_enqueue(
                bot_id=ops_bot,
                chat_id=chat,
                payload={"text": digest.text},
                idempotency_key=f"ops-digest:{digest.kind}:{about}{digest.window}",
                # Unordered: a digest the ops bot cannot send holds up no later digest.
                ordered=False,
            )
    except Exception:
        logger.exception("ops digest %s could not be written to the outbox", digest.kind)


@receiver(ops_digest, dispatch_uid="reconciliation.digest.email")
def _email(sender: Any, *, kind: str, text: str, **kwargs: Any) -> None:
    if settings.DOVECOTE_OPS_EMAILS:
        send_mail(f"Dovecote: {kind.replace('_', ' ')}", text, None, list(settings.DOVECOTE_OPS_EMAILS))


@receiver(ops_digest, dispatch_uid="reconciliation.digest.notifiers")
def _notifiers(sender: Any, **kwargs: Any) -> None:
    for path in settings.DOVECOTE_OPS_NOTIFIERS:
        try:
            import_string(path)(**kwargs)
        except Exception:
            # One broken channel stops neither the others nor the sweep.
            logger.exception("ops notifier %s failed", path)
