"""Retention: the outbox's tables, and the batching every app's retention runs on.

A pass is a list of tasks; each step handles one batch of at most DOVECOTE_RETENTION_BATCH_SIZE
rows in its own short transaction. `run` takes one batch of each task in turn until all are
done or DOVECOTE_RETENTION_BUDGET_SECONDS is spent; the next sweep continues. What the apps
above need kept they pass in as `keep` conditions. Why: docs/DESIGN.md."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import CASCADE, DO_NOTHING, SET_NULL, Exists, Model, OuterRef, QuerySet, signals
from django.utils import timezone

from outbox import sql
from outbox.idempotency import idempotency_cutoff
from outbox.models import DeadLetter, DeadLetterStatus, Effect, EffectState, IdempotencyRecord, OutboundMessage, State

# Payload keys that carry what a person wrote or who they are; purged after retention.
PERSONAL_PAYLOAD_KEYS = frozenset(
    {
        "text",
        "caption",
        "reply_markup",
        "entities",
        "caption_entities",
        "phone_number",
        "first_name",
        "last_name",
        "vcard",
        "question",
        "options",
        "explanation",
        "latitude",
        "longitude",
        "address",
        "title",
        "media",
        "photo",
        "document",
        "video",
        "audio",
        "voice",
        "animation",
        "sticker",
    }
)

# One batch: (rows handled, whether more may be left).
Step = Callable[[], tuple[int, bool]]


@dataclass
class Budget:
    """How long one pass may take (wall clock, checked between batches)."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def spent(self) -> bool:
        return time.monotonic() - self.started >= self.seconds


@dataclass(frozen=True)
class Task:
    name: str  # the sweeper's report key
    step: Step


def budget() -> Budget:
    return Budget(float(settings.DOVECOTE_RETENTION_BUDGET_SECONDS))


def batch_size() -> int:
    return max(1, int(settings.DOVECOTE_RETENTION_BATCH_SIZE))


def run(tasks: Sequence[Task], budget: Budget, report: dict[str, int]) -> bool:
    """One batch of each unfinished task in turn. True when every task finished (nothing
    old is left); False when the budget ran out first. The budget is looked at after a batch
    that did something (a task with nothing to do costs one index probe), so even a budget
    of 0 removes one batch per pass: a tiny budget is slow, never stuck."""
    active = list(tasks)
    while active:
        for task in list(active):
            handled, more = task.step()
            report[task.name] = report.get(task.name, 0) + handled
            if not more:
                active.remove(task)
            if handled and budget.spent():
                return not active
    return True


def delete_step(rows: Callable[[], QuerySet[Any]], order: str, *, size: int | None = None) -> Step:
    """A step that deletes the next `size` rows of `rows()` in `order` (an indexed column),
    with whatever Django cascades to. The rows are picked FOR UPDATE SKIP LOCKED in the same
    transaction as the DELETE, so a row a transition is changing right now (a requeue, a
    decision) is left for the next pass instead of deleted from under it; the conditions are
    evaluated again at the DELETE's moment, not at some earlier read. A cursor on `order`
    keeps the next batch from re-reading rows this pass decided to keep."""
    size = size or batch_size()
    cursor: list[Any] = []

    def step() -> tuple[int, bool]:
        qs = rows()
        model = qs.model
        if cursor:
            qs = qs.filter(**{f"{order}__gte": cursor[0]})
        with transaction.atomic():
            picked = list(qs.order_by(order).select_for_update(skip_locked=True).values_list("pk", order)[:size])
            if not picked:
                return 0, False
            deleted = delete_rows(model, [pk for pk, _ in picked])
        cursor[:] = [picked[-1][1]]
        return deleted, len(picked) == size

    return step


def delete_rows(model: type[Model], ids: list[int]) -> int:
    """Delete these rows and what Django would cascade to, in the caller's transaction.

    One statement per related table with the ids as one array parameter
    (`= ANY(%s)`), following the models' on_delete (CASCADE recursively, SET_NULL). Django's
    collector does the same work but builds its queries from model instances, and spent far
    longer in Python than PostgreSQL spent deleting (docs/PERFORMANCE.md). Anything else -
    a delete signal receiver, an on_delete other than CASCADE, SET_NULL or
    DO_NOTHING - goes through Django's collector.
    """
    if _fast_deletable(model, set()):
        with connection.cursor() as cursor:
            return _delete_pg(cursor, model, ids)
    return model.objects.filter(pk__in=ids).only("pk").delete()[1].get(model._meta.label, 0)


def _fast_deletable(model: type[Model], seen: set[type[Model]]) -> bool:
    if model in seen:
        return False  # a cycle: leave it to Django
    if signals.pre_delete.has_listeners(model) or signals.post_delete.has_listeners(model):
        return False
    for rel in model._meta.related_objects:
        on_delete = rel.on_delete
        if rel.many_to_many or on_delete not in (CASCADE, SET_NULL, DO_NOTHING):
            return False
        if on_delete is CASCADE and not _fast_deletable(rel.related_model, seen | {model}):
            return False
    return True


def _delete_pg(cursor: Any, model: type[Model], ids: list[int]) -> int:
    for rel in model._meta.related_objects:
        related, column = rel.related_model, rel.field.column
        if rel.on_delete is SET_NULL:
            cursor.execute(sql.set_null(related, column), [ids])
        elif rel.on_delete is CASCADE:
            if related._meta.related_objects:
                cursor.execute(sql.ids_where(related, column), [ids])
                children = [row[0] for row in cursor.fetchall()]
                if children:
                    _delete_pg(cursor, related, children)
            else:
                cursor.execute(sql.delete_where(related, column), [ids])
    cursor.execute(sql.delete_where(model, model._meta.pk.column), [ids])
    return cursor.rowcount


def boundary_id(model: type[Model], field_name: str, cutoff: datetime) -> int | None:
    """The largest id whose `field_name` is before `cutoff`, by binary search on the primary
    key (ids grow with time): ~log2(n) index lookups, no index on the time column needed."""
    first = model.objects.order_by("pk").values_list("pk", field_name).first()
    if first is None or first[1] >= cutoff:
        return None
    lo = first[0]
    hi = model.objects.order_by("-pk").values_list("pk", flat=True).first()
    while lo < hi:
        mid = (lo + hi + 1) // 2
        row = model.objects.filter(pk__gte=mid).order_by("pk").values_list("pk", field_name).first()
        if row is not None and row[1] < cutoff:
            lo = row[0]  # >= mid: progress even across gaps in the ids
        else:
            hi = mid - 1
    return lo


def ledger_cutoff(now: datetime) -> datetime:
    """Dedupe (inbound updates) and ledger (effects) rows are kept until here. Never under
    Telegram's 24 hours of update redelivery: a pruned dedupe row would let a redelivered
    update in twice."""
    return now - timedelta(days=max(1, int(settings.DOVECOTE_LEDGER_RETENTION_DAYS)))


def days_setting(name: str) -> int:
    """A retention setting (settings.py defines each; 0 keeps the rows)."""
    return int(getattr(settings, name))


def cutoff_not_before_ledger(now: datetime, days: int) -> datetime:
    """`days` ago, but never later than the ledger's cutoff: a message's key must outlive the
    updates and effects that could ask for it again."""
    return min(now - timedelta(days=days), ledger_cutoff(now))


# --------------------------------------------------------------------------- queries
def _without(qs: QuerySet[Any], keep: Iterable[Exists]) -> QuerySet[Any]:
    for condition in keep:
        qs = qs.filter(~condition)
    return qs


def open_dead_letter_exists() -> Exists:
    """On OutboundMessage: an operator still has this message's dead letter to triage."""
    return Exists(DeadLetter.objects.filter(message=OuterRef("pk"), status=DeadLetterStatus.OPEN))


def messages_prunable_qs(state: str, cutoff: datetime, keep: Iterable[Exists] = ()) -> QuerySet[OutboundMessage]:
    """Messages in one final `state` last changed before `cutoff`, with no open dead letter
    and none of the callers' `keep` conditions. One state at a time: ordered by updated_at,
    it is a range scan of outbox_state_updated_idx (state, updated_at)."""
    qs = OutboundMessage.objects.filter(state=state, updated_at__lt=cutoff).filter(~open_dead_letter_exists())
    return _without(qs, keep)


def effects_prunable_qs(cutoff: datetime, keep: Iterable[Exists] = ()) -> QuerySet[Effect]:
    # Unknown and started effects are kept: they have cases, or may still be running.
    qs = Effect.objects.filter(created_at__lt=cutoff, state__in=[EffectState.DONE, EffectState.FAILED])
    return _without(qs, keep)


def payloads_purgeable_qs(cutoff: datetime) -> QuerySet[OutboundMessage]:
    """Sent messages whose text is still kept; outbox_purge_idx holds exactly these."""
    return OutboundMessage.objects.filter(state=State.SENT, sent_at__lt=cutoff, payload_purged_at__isnull=True)


def idempotency_prunable_qs(cutoff: datetime) -> QuerySet[IdempotencyRecord]:
    return IdempotencyRecord.objects.filter(created_at__lt=cutoff)


# --------------------------------------------------------------------------- payload purge
def outbound_payloads_purge_batch(older_than: datetime, *, size: int | None = None) -> int:
    """Blank text, markup and captions of up to `size` messages sent before `older_than`;
    metadata (chat, method, states, attempts, key, Telegram's message id) stays."""
    with transaction.atomic():
        batch = list(
            payloads_purgeable_qs(older_than)
            .only("pk", "payload", "result")
            .order_by("sent_at")
            .select_for_update(skip_locked=True)[: size or batch_size()]
        )
        if not batch:
            return 0
        now = timezone.now()
        for message in batch:
            payload = message.payload if isinstance(message.payload, dict) else {}
            message.payload = {k: v for k, v in payload.items() if k not in PERSONAL_PAYLOAD_KEYS}
            message.result = None
            message.payload_purged_at = now
        OutboundMessage.objects.bulk_update(batch, ["payload", "result", "payload_purged_at"])
    return len(batch)


def _purge_step(older_than: datetime) -> Step:
    size = batch_size()

    def step() -> tuple[int, bool]:
        n = outbound_payloads_purge_batch(older_than, size=size)
        return n, n == size

    return step


# --------------------------------------------------------------------------- the outbox's tasks
def tasks(now: datetime, *, keep_messages: Sequence[Exists] = (), keep_effects: Sequence[Exists] = ()) -> list[Task]:
    """The outbox's retention tasks as of `now`.

    - sent messages lose their text after DOVECOTE_PAYLOAD_RETENTION_DAYS;
    - API idempotency records go after DOVECOTE_IDEMPOTENCY_KEEP_HOURS (at least 24);
    - done and failed effects go after DOVECOTE_LEDGER_RETENTION_DAYS (at least 1);
    - sent and cancelled messages, with their attempts, after DOVECOTE_OUTBOX_RETENTION_DAYS;
    - failed and unknown ones after DOVECOTE_FAILED_RETENTION_DAYS, counted from their last
      change, and only once no dead letter of theirs is open (and, through `keep_messages`,
      no case): an operator's open work is never deleted.
    A message retention of 0 days keeps those messages for ever; no message goes before the
    ledger's cutoff.
    """
    payload_cutoff = now - timedelta(days=max(0, int(settings.DOVECOTE_PAYLOAD_RETENTION_DAYS)))
    result = [
        Task("payloads_purged", _purge_step(payload_cutoff)),
        Task(
            "idempotency_records_pruned",
            delete_step(lambda: idempotency_prunable_qs(idempotency_cutoff(now)), "created_at"),
        ),
        Task(
            "effects_pruned",
            delete_step(lambda: effects_prunable_qs(ledger_cutoff(now), keep_effects), "created_at"),
        ),
    ]
    finished = days_setting("DOVECOTE_OUTBOX_RETENTION_DAYS")
    failed = days_setting("DOVECOTE_FAILED_RETENTION_DAYS")
    for states, days in (([State.SENT, State.CANCELLED], finished), ([State.FAILED, State.UNKNOWN], failed)):
        if days <= 0:
            continue
        cutoff = cutoff_not_before_ledger(now, days)
        for state in states:
            result.append(
                Task(
                    "messages_pruned",
                    delete_step(
                        lambda state=state, cutoff=cutoff: messages_prunable_qs(state, cutoff, keep_messages),
                        "updated_at",
                    ),
                )
            )
    return result
