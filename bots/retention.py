"""Retention of the inbox: dedupe rows (updates), their text, and the reply guard (chat
states). Batched and budgeted by the outbox's retention steps (outbox/retention.py); the sweeper runs the tasks.

Whatever the settings: an update is kept at least 24 hours (Telegram's redelivery window), and
longer while a run may still read it or a dead letter of it is open, with every message it
sent (the key that stops a retried run from sending twice); a chat's guard goes only when
nothing could ask it again. The reasons: docs/DESIGN.md."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, QuerySet
from django.db.models.functions import JSONObject
from django.utils import timezone

from bots.models import ChatState, ConsumerRun, HandlerCall, InboundUpdate, RunState, UpdateState
from bots.replies import GATHER_WINDOW
from outbox.models import DeadLetter, DeadLetterStatus
from outbox.services import (
    RetentionStep,
    RetentionTask,
    retention_batch_size,
    retention_boundary_id,
    retention_cutoff_not_before_ledger,
    retention_days_setting,
    retention_delete_step,
    retention_ledger_cutoff,
)

UNFINISHED_RUNS = [RunState.PENDING, RunState.RUNNING, RunState.RETRY]


def live_run_exists(**update: Any) -> list[Exists]:
    """Runs of the update(s) selected by `update` (lookups on ConsumerRun.update) that may
    still act: unfinished, or dead-lettered with the letter open (an operator may retry it).
    Two conditions, not one OR, so each is served by a partial index (run_due_idx and
    run_lease_idx; deadletter_triage_idx) instead of a scan of every run."""
    runs = ConsumerRun.objects.filter(state__in=UNFINISHED_RUNS, **{f"update__{k}": v for k, v in update.items()})
    letters = DeadLetter.objects.filter(
        status=DeadLetterStatus.OPEN, **{f"consumer_run__update__{k}": v for k, v in update.items()}
    )
    return [Exists(runs), Exists(letters)]


def _without(qs: QuerySet[Any], conditions: list[Exists]) -> QuerySet[Any]:
    for condition in conditions:
        qs = qs.filter(~condition)
    return qs


def keep_messages() -> list[Exists]:
    """What the outbox must keep for the inbox: messages whose update may still run again
    and ask for their keys."""
    return live_run_exists(id=OuterRef("source_update_id"))


def updates_prunable_qs(cutoff: datetime, max_id: int) -> QuerySet[InboundUpdate]:
    """Routed updates received before `cutoff` (ids up to `max_id`, see boundary_id) whose
    runs all finished well (done or cancelled)."""
    not_well = ConsumerRun.objects.filter(update=OuterRef("pk")).exclude(state__in=[RunState.DONE, RunState.CANCELLED])
    return InboundUpdate.objects.filter(id__lte=max_id, state=UpdateState.DONE, received_at__lt=cutoff).filter(
        ~Exists(not_well)
    )


def updates_failed_prunable_qs(cutoff: datetime, max_id: int) -> QuerySet[InboundUpdate]:
    """Updates with a failed or cancelled run, received before `cutoff`, with nothing left
    to do: no run unfinished and no dead letter open."""
    qs = InboundUpdate.objects.filter(id__lte=max_id, state=UpdateState.DONE, received_at__lt=cutoff)
    return _without(qs, live_run_exists(id=OuterRef("pk")))


def payloads_purgeable_qs(cutoff: datetime) -> QuerySet[InboundUpdate]:
    """Updates received before `cutoff` whose text is still kept (inbox_purge_idx), with no
    run that may still read it."""
    qs = InboundUpdate.objects.filter(received_at__lt=cutoff, payload_purged_at__isnull=True, state=UpdateState.DONE)
    return _without(qs, live_run_exists(id=OuterRef("pk")))


def chat_states_prunable_qs(cutoff: datetime) -> QuerySet[ChatState]:
    """Chat states unchanged since before `cutoff`, of chats with no update since and no
    live run (see the module's docstring)."""
    recent = InboundUpdate.objects.filter(
        bot_id=OuterRef("bot_id"), chat_id=OuterRef("chat_id"), received_at__gte=cutoff
    )
    qs = ChatState.objects.filter(updated_at__lt=cutoff).filter(~Exists(recent))
    return _without(qs, live_run_exists(bot_id=OuterRef("bot_id"), chat_id=OuterRef("chat_id")))


def handler_results_purgeable_qs(cutoff: datetime) -> QuerySet[HandlerCall]:
    """Journaled calls of python-telegram-bot handlers (bots/ptb) answered before `cutoff`
    whose result (a whole message, with its text) is still kept, of updates no run may
    handle again (a re-run replays the results)."""
    qs = HandlerCall.objects.filter(answered_at__lt=cutoff, result_purged_at__isnull=True)
    return _without(qs, live_run_exists(id=OuterRef("update_id")))


def handler_results_purge_batch(older_than: datetime, *, size: int | None = None) -> int:
    """Blank the results of up to `size` journaled calls; method, target and outcome stay."""
    qs = handler_results_purgeable_qs(older_than)
    return _change_batch(qs, "answered_at", size, result=None, result_purged_at=timezone.now())


def _change_batch(qs: QuerySet[Any], oldest_first: str, size: int | None, **values: Any) -> int:
    """Set `values` on up to `size` rows of `qs`, oldest first, skipping rows another
    sweeper holds; returns how many."""
    with transaction.atomic():
        ids = list(
            qs.order_by(oldest_first)
            .select_for_update(skip_locked=True)
            .values_list("pk", flat=True)[: size or retention_batch_size()]
        )
        if ids:
            qs.model.objects.filter(pk__in=ids).update(**values)
    return len(ids)


def inbound_payloads_purge_batch(older_than: datetime, *, size: int | None = None) -> int:
    """Cut up to `size` updates' payloads to their update_id. Dedupe works on the
    (bot, update_id) columns, and chat, user, message id and type stay in theirs."""
    qs = payloads_purgeable_qs(older_than)
    return _change_batch(
        qs, "received_at", size, payload=JSONObject(update_id="update_id"), payload_purged_at=timezone.now()
    )


def _purge_step(older_than: datetime, purge: Any = None) -> RetentionStep:
    size = retention_batch_size()
    purge = purge or inbound_payloads_purge_batch

    def step() -> tuple[int, bool]:
        n = purge(older_than, size=size)
        return n, n == size

    return step


def tasks(now: datetime) -> list[RetentionTask]:
    """The inbox's retention tasks as of `now`:

    - update payloads are cut to their update_id after DOVECOTE_PAYLOAD_RETENTION_DAYS, and
      the results python-telegram-bot handlers' calls got (bots/ptb's journal) blanked;
    - updates whose runs all finished well go after DOVECOTE_LEDGER_RETENTION_DAYS;
    - updates with a failed or cancelled run go after DOVECOTE_FAILED_RETENTION_DAYS, once no
      dead letter of theirs is open (0 keeps them);
    - chat states go after DOVECOTE_CHAT_STATE_RETENTION_DAYS of quiet (0 keeps them).
    """
    ledger = retention_ledger_cutoff(now)
    # Never inside the window a burst's answer gathers texts from.
    payload_days = timedelta(days=max(0, int(settings.DOVECOTE_PAYLOAD_RETENTION_DAYS)))
    payload_cutoff = now - max(payload_days, GATHER_WINDOW)
    result = [
        RetentionTask("inbound_payloads_purged", _purge_step(payload_cutoff)),
        RetentionTask("handler_results_purged", _purge_step(payload_cutoff, handler_results_purge_batch)),
    ]
    boundary = retention_boundary_id(InboundUpdate, "received_at", ledger)
    if boundary is not None:
        result.append(
            RetentionTask("updates_pruned", retention_delete_step(lambda: updates_prunable_qs(ledger, boundary), "pk"))
        )
    failed_days = retention_days_setting("DOVECOTE_FAILED_RETENTION_DAYS")
    if failed_days > 0:
        failed = retention_cutoff_not_before_ledger(now, failed_days)
        failed_boundary = retention_boundary_id(InboundUpdate, "received_at", failed)
        if failed_boundary is not None:
            result.append(
                RetentionTask(
                    "updates_pruned",
                    retention_delete_step(lambda: updates_failed_prunable_qs(failed, failed_boundary), "pk"),
                )
            )
    chat_days = retention_days_setting("DOVECOTE_CHAT_STATE_RETENTION_DAYS")
    if chat_days > 0:
        # Never inside the window a new burst gathers from, nor while dedupe rows of the
        # chat's old updates could still let one in.
        chats = min(retention_cutoff_not_before_ledger(now, chat_days), now - GATHER_WINDOW)
        step = retention_delete_step(lambda: chat_states_prunable_qs(chats), "updated_at")
        result.append(RetentionTask("chat_states_pruned", step))
    return result
