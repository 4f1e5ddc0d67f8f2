"""The ops digest: new dead letters by reason, cases opened, circuits opened and closed, sent
to the operators' Telegram chat as an ordinary outbox message, by e-mail, and to any channel
a developer adds (the `ops_digest` signal or DOVECOTE_OPS_NOTIFIERS).

Counted from the rows themselves, not from counters bumped on the hot path: a dead letter,
a case or a circuit change that rolled back is never counted, nothing is lost when Redis
restarts, and the send path gains no work. The sweeper's `_ops_digest` step calls `flush`
every sweep; each kind is sent at most once per DOVECOTE_OPS_DIGEST_MINUTES, counted from its
previous digest, not by the clock's windows (claimed in Redis atomically, so two beat instances
send one; the outbox key `ops-digest:<kind>:<window>`, the claim's second, makes a retried
digest one message); whatever happens after a kind's digest waits for the next one.

The ops bot never reports on itself: its own dead letters, cases and circuit are left out,
so a failing ops bot cannot feed an endless digest about its failures. Its messages are
unordered outbox messages of its own bot: when it fails (token refused, circuit open) they
wait or dead-letter like any other, and nothing of the bot it reports on waits for them.
"""

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

from outbox import ratelimit
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


def count(kind: str, since: datetime, until: datetime, *, ops_bot: int | None) -> dict[str, int]:
    """What happened in [since, until), leaving out the ops bot's own trouble."""
    if kind == "dead_letters":
        rows = DeadLetter.objects.filter(created_at__gte=since, created_at__lt=until)
        if ops_bot is not None:
            rows = rows.exclude(bot_id=ops_bot)
        by_reason = rows.values("reason_class").annotate(n=Count("id")).order_by("-n", "reason_class")
        return {row["reason_class"]: row["n"] for row in by_reason}
    if kind == "cases":
        cases = ReconciliationCase.objects.filter(created_at__gte=since, created_at__lt=until)
        if ops_bot is not None:
            cases = cases.exclude(message__bot_id=ops_bot)
        n = cases.count()
        return {"opened": n} if n else {}
    if kind == "circuits":
        circuits = Circuit.objects.all()
        if ops_bot is not None:
            circuits = circuits.exclude(scope=bot_scope(ops_bot))
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


def render(kind: str, counts: dict[str, int], *, minutes: int) -> str:
    head = f"Dovecote ops digest (last {minutes} min or since the previous one)"
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


def _since(kind: str, now: datetime) -> datetime:
    value = ratelimit.redis_client().get(_key(kind, "since"))
    if value is None:
        return now - timedelta(minutes=window_minutes())
    return datetime.fromtimestamp(float(value), tz=UTC)


# Claim the kind's next digest at `now` when its previous one is at least a window old: one
# step, so two sweepers (two beat instances) cannot both claim it.
_CLAIM_LUA = """
local last = redis.call('GET', KEYS[1])
if last and tonumber(ARGV[1]) < tonumber(last) + tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return 1
"""


def claim_key(kind: str) -> str:
    return _key(kind, "last")


def _claim(kind: str, now: datetime) -> int | None:
    """The claimed digest's second, or None while the kind's previous digest is too recent."""
    stamp = int(now.timestamp())
    seconds = window_minutes() * 60
    claimed = ratelimit.redis_client().eval(_CLAIM_LUA, 1, claim_key(kind), stamp, seconds, seconds * 2)
    return stamp if claimed else None


def _advance(kind: str, until: datetime) -> None:
    ratelimit.redis_client().set(_key(kind, "since"), until.timestamp())


# --- sending ----------------------------------------------------------------------------


def flush(now: datetime) -> list[Digest]:
    """Send what each kind has gathered since its last digest, if its window is free.
    Called by the sweeper; never raises for a channel's failure."""
    if not enabled():
        return []
    ops_bot = ops_bot_id()
    sent = []
    for kind in KINDS:
        since = _since(kind, now)
        counts = count(kind, since, now, ops_bot=ops_bot)
        if not counts:
            _advance(kind, now)
            continue
        window = _claim(kind, now)
        if window is None:
            continue  # this kind's previous digest is too recent: the counts wait for the next
        digest = Digest(kind, counts, render(kind, counts, minutes=window_minutes()), window)
        _to_telegram(digest, ops_bot)
        ops_digest.send_robust(sender=None, kind=kind, counts=counts, text=digest.text, window=window)
        _advance(kind, now)
        sent.append(digest)
    return sent


def _to_telegram(digest: Digest, ops_bot: int | None) -> None:
    if ops_bot is None or not settings.DOVECOTE_OPS_CHAT_ID:
        if settings.DOVECOTE_OPS_BOT:
            logger.warning("ops digest: no bot named %r", settings.DOVECOTE_OPS_BOT)
        return
    from outbox.services import outbound_message_enqueue

    try:
        with transaction.atomic():
            outbound_message_enqueue(
                bot_id=ops_bot,
                chat_id=int(settings.DOVECOTE_OPS_CHAT_ID),
                payload={"text": digest.text},
                idempotency_key=f"ops-digest:{digest.kind}:{digest.window}",
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
