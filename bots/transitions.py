"""State changes of inbound updates and consumer runs, each one conditional UPDATE.

Update: new -> done (routed: one run per matching consumer, written with it: `route`).
Run: pending|retry -> running (claim) -> done | retry | failed | cancelled;
running -> pending (deferred: the consumer asked to run later, no attempt spent);
running with an expired lease -> retry, or failed once its budget is spent (sweeper);
pending|retry past the consumer's max age -> cancelled, or failed when a failure is on record.
Chat: last answered message id only moves forward (the reply guard).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import F, Q
from django.db.models.functions import Greatest
from django.utils import timezone

from bots import sql
from bots.models import Bot, ChatState, ConsumerRun, InboundUpdate, RunState, UpdateState
from core import rows

RUN_WAITING = [RunState.PENDING, RunState.RETRY]


def updates_to_route(
    *, bot_id: int | None = None, update_pk: int | None = None, limit: int, circuits: list[str] | None = None
) -> list[InboundUpdate]:
    """Up to `limit` of a bot's new updates (or the one update `update_pk`), oldest first
    (through inbox_new_idx: a batch, not the whole backlog), their bot read in the same
    statement. Read, not locked: `route` decides which of them this router routes.

    `circuits`: scopes whose circuit the router needs; each update then carries
    `unsettled_circuits`, those of them not plainly closed, read by the same statement.
    One fixed, prepared statement (the router's read on every nudge): the rows and instances
    of the queryset, without its compile each time."""
    if (bot_id is None) == (update_pk is None):
        raise ValueError("take the updates of one bot, or one update")
    params: list[Any] = [circuits] if circuits else []
    params += [bot_id if bot_id is not None else update_pk, limit]
    update_fields = len(InboundUpdate._meta.concrete_fields)
    bot_fields = len(Bot._meta.concrete_fields)
    found = []
    bot: Bot | None = None  # every row is of one bot, read once by the statement: one instance
    for row in rows.fetch(sql.updates_to_route(by_bot=bot_id is not None, with_circuits=bool(circuits)), params):
        update = rows.from_row(InboundUpdate, row[:update_fields])
        if bot is None:
            bot = rows.from_row(Bot, row[update_fields : update_fields + bot_fields])
        InboundUpdate.bot.field.set_cached_value(update, bot)
        if circuits:
            update.unsettled_circuits = row[-1]
        found.append(update)
    return found


def route(updates: list[InboundUpdate], runs: list[ConsumerRun]) -> set[int]:
    """new -> done for these updates, with their consumer runs written, together, in one
    statement (an UPDATE of the updates still new, and the insert of the runs of exactly
    those; one round trip, no transaction around it).
    An update another router moved first, or is moving (SKIP LOCKED), is left to it, its runs
    not written here. Returns the ids of the updates routed here; each run written gets its pk.
    Committed asynchronously (core/rows.py): a routing that PostgreSQL loses in a crash
    leaves the update new, and the sweeper routes it again."""
    if not updates:
        return set()
    now = timezone.now()
    # An update another router is marking is its own (SKIP LOCKED: sql.ROUTE_MARK says why).
    return rows.insert_many_with(
        runs,
        unique=("update_id", "consumer"),
        mark=sql.ROUTE_MARK,
        mark_params=[[u.pk for u in updates], now],
        of="update_id",
        async_commit=True,
    )


def make_update_due(update_id: int, *, now: datetime) -> bool:
    """new -> new, due now (the sweeper redispatches an update whose routing was lost)."""
    return InboundUpdate.objects.filter(pk=update_id, state=UpdateState.NEW).update(next_attempt_at=now) == 1


def make_run_due(run_id: int, *, now: datetime) -> bool:
    """pending|retry -> the same, due now (the sweeper redispatches a run whose task was lost)."""
    return ConsumerRun.objects.filter(pk=run_id, state__in=RUN_WAITING).update(next_attempt_at=now) == 1


def claim_run(run_id: int, *, worker: str, lease: timedelta) -> bool:
    """pending|retry -> running. False when another worker got it first or it is not due."""
    now = timezone.now()
    n = ConsumerRun.objects.filter(pk=run_id, state__in=RUN_WAITING, next_attempt_at__lte=now).update(
        state=RunState.RUNNING,
        lease_owner=worker,
        lease_expires_at=now + lease,
        attempts=F("attempts") + 1,
        updated_at=now,
    )
    return n == 1


def claim_runs(run_ids: list[int], *, worker: str, lease: timedelta) -> dict[int, int]:
    """pending|retry -> running for those of `run_ids` that are due and not taken, in one
    statement (the router's inline runs). Returns {run id: its attempts, this one counted}."""
    if not run_ids:
        return {}
    now = timezone.now()
    return dict(rows.fetch(sql.CLAIM_RUNS, [worker, now + lease, now, run_ids, now]))


def renew_run_leases(run_ids: list[int], *, worker: str, lease: timedelta) -> int:
    """running -> running with a fresh lease, for the runs this worker still holds (the lease
    keeper's tick, core/workers.py). Not `updated_at`: a renewal changes nothing of the run."""
    return ConsumerRun.objects.filter(pk__in=run_ids, state=RunState.RUNNING, lease_owner=worker).update(
        lease_expires_at=timezone.now() + lease
    )


def _owned(run_id: int, worker: str):
    return ConsumerRun.objects.filter(pk=run_id, state=RunState.RUNNING, lease_owner=worker)


def mark_run_done(run_id: int, *, worker: str, outcome: str = "") -> bool:
    """running -> done, for a run this worker holds."""
    return mark_runs_done({run_id: outcome}, worker=worker) == 1


def mark_runs_done(outcomes: dict[int, str], *, worker: str) -> int:
    """running -> done for the runs this worker holds, each with its outcome ({run id:
    outcome}), in one statement (the router's inline runs); returns how many. Committed
    asynchronously (core/rows.py): a done mark lost in a crash of PostgreSQL leaves the
    run running, and the sweeper runs it again once its lease is over, as after a worker's
    crash (what the run did is in rows its next run finds: its reply's key, its effects)."""
    if not outcomes:
        return 0
    now = timezone.now()
    return rows.execute(
        sql.MARK_RUNS_DONE,
        [now, now, list(outcomes), [o[:64] for o in outcomes.values()], worker],
        async_commit=True,
    )


def defer_run(run_id: int, *, worker: str, until: datetime, reason: str = "") -> bool:
    """running -> pending until `until`. Waiting is not a failure: the attempt is given back."""
    now = timezone.now()
    n = _owned(run_id, worker).update(
        state=RunState.PENDING,
        next_attempt_at=until,
        attempts=Greatest(F("attempts") - 1, 0),
        updated_at=now,
        lease_owner="",
        lease_expires_at=None,
        outcome=reason[:64],
    )
    return n == 1


def postpone_run(run_id: int, *, until: datetime) -> bool:
    """A waiting run whose destination is paused (open circuit): due again at the probe time,
    so the sweeper does not keep redispatching it meanwhile."""
    n = ConsumerRun.objects.filter(pk=run_id, state__in=RUN_WAITING, next_attempt_at__lt=until).update(
        next_attempt_at=until, updated_at=timezone.now()
    )
    return n == 1


def schedule_run_retry(
    run_id: int, *, worker: str, delay: float, error: str, error_class: str, free: bool = False
) -> bool:
    now = timezone.now()
    fields = {
        "state": RunState.RETRY,
        "next_attempt_at": now + timedelta(seconds=delay),
        "updated_at": now,
        "lease_owner": "",
        "lease_expires_at": None,
        "last_error": error[:2000],
        "last_error_class": error_class,
    }
    if free:
        # An auth pause is not the run's fault: it does not spend the budget.
        fields["max_attempts"] = F("max_attempts") + 1
    return _owned(run_id, worker).update(**fields) == 1


def fail_run(run_id: int, *, worker: str | None, error: str, error_class: str) -> bool:
    """running (or waiting, with worker=None) -> failed. The caller writes the dead letter."""
    now = timezone.now()
    rows = _owned(run_id, worker) if worker else ConsumerRun.objects.filter(pk=run_id, state__in=RUN_WAITING)
    n = rows.update(**_ended(RunState.FAILED, now), last_error=error[:2000], last_error_class=error_class)
    return n == 1


def _ended(state: str, now: datetime) -> dict[str, Any]:
    """The fields every run's end sets: its state, when, and no lease any more."""
    return {"state": state, "finished_at": now, "updated_at": now, "lease_owner": "", "lease_expires_at": None}


def _cancelled_fields(reason: str, now: datetime) -> dict[str, Any]:
    return {**_ended(RunState.CANCELLED, now), "cancel_reason": reason[:2000]}


def cancel_run(run_id: int, *, reason: str, worker: str | None = None) -> bool:
    now = timezone.now()
    rows = _owned(run_id, worker) if worker else ConsumerRun.objects.filter(pk=run_id, state__in=RUN_WAITING)
    return rows.update(**_cancelled_fields(reason, now)) == 1


def _expired(run_id: int, now: datetime):
    return ConsumerRun.objects.filter(pk=run_id, state=RunState.RUNNING, lease_expires_at__lt=now)


def release_expired_run(run_id: int, *, delay: float, error: str) -> bool:
    """running past its lease (the worker died or hung) -> retry after `delay`, while the run
    has budget left. The claim counted the attempt; it failed. The consumer's effects are
    guarded by stable keys, so running it again is safe."""
    now = timezone.now()
    n = (
        _expired(run_id, now)
        .filter(attempts__lt=F("max_attempts"))
        .update(
            state=RunState.RETRY,
            next_attempt_at=now + timedelta(seconds=delay),
            lease_owner="",
            lease_expires_at=None,
            updated_at=now,
            last_error=error[:2000],
            last_error_class="transient",
        )
    )
    return n == 1


def release_own_runs(*, worker: str, claimed_before: datetime, alive: list[int] | None = None) -> list[int]:
    """running -> retry, due now, for the runs this worker claimed before `claimed_before`
    and no longer works on: the task that held them failed when PostgreSQL or Redis went
    away (reconciliation/resume.py). `alive`: runs this process still works on (an awaiting
    run on the event loop, a run waiting for its model or CRM), never released. Its consumer
    did not fail, so the attempt is given back (max_attempts + 1, as an auth pause). Returns
    their ids."""
    now = timezone.now()
    released = rows.fetch(
        sql.RELEASE_OWN_RUNS,
        [now, now, "its worker lost PostgreSQL or Redis mid-run", worker, claimed_before, list(alive or ())],
    )
    return [pk for (pk,) in released]


def fail_expired_run(run_id: int, *, error: str) -> bool:
    """running past its lease with its budget spent -> failed (exhausted). The caller writes
    the dead letter in the same transaction."""
    now = timezone.now()
    n = (
        _expired(run_id, now)
        .filter(attempts__gte=F("max_attempts"))
        .update(**_ended(RunState.FAILED, now), last_error=error[:2000], last_error_class="exhausted")
    )
    return n == 1


def cancel_stale_run(run_id: int, *, reason: str) -> bool:
    """waiting, past max age, nothing failed yet (never run, or only deferred or paused)
    -> cancelled. A run with a failure on record goes to fail_stale_run instead."""
    now = timezone.now()
    rows = ConsumerRun.objects.filter(pk=run_id, state__in=RUN_WAITING, last_error="")
    return rows.update(**_cancelled_fields(reason, now)) == 1


def fail_stale_run(run_id: int) -> bool:
    """waiting, past max age, with a failure on record -> failed (expired): it is not run
    late, and not silently cancelled either. The caller writes the dead letter; the run's
    last error stays the failure it had."""
    now = timezone.now()
    n = (
        ConsumerRun.objects.filter(pk=run_id, state__in=RUN_WAITING)
        .exclude(last_error="")
        .update(**_ended(RunState.FAILED, now), last_error_class="expired")
    )
    return n == 1


def reset_run_for_retry(run_id: int, *, from_states: list[str]) -> bool:
    """failed|cancelled -> retry (an operator's decision); gives the run one more attempt."""
    from django.db.models.functions import Greatest

    now = timezone.now()
    n = ConsumerRun.objects.filter(pk=run_id, state__in=from_states).update(
        state=RunState.RETRY,
        next_attempt_at=now,
        max_attempts=Greatest(F("max_attempts"), F("attempts") + 1),
        finished_at=None,
        updated_at=now,
    )
    return n == 1


def mark_chat_answered(*, bot_id: int, chat_id: int, upto_message_id: int) -> bool:
    """Move the chat's reply guard forward to `upto_message_id`. False when messages up to it
    were already answered (another worker got there first): the caller must not answer."""
    ChatState.objects.bulk_create([ChatState(bot_id=bot_id, chat_id=chat_id)], ignore_conflicts=True)
    now = timezone.now()
    n = (
        ChatState.objects.filter(bot_id=bot_id, chat_id=chat_id)
        .filter(Q(last_answered_message_id__isnull=True) | Q(last_answered_message_id__lt=upto_message_id))
        .update(last_answered_message_id=upto_message_id, last_answered_at=now, updated_at=now)
    )
    return n == 1


def note_chat_answered(*, bot_id: int, chat_id: int, message_id: int) -> None:
    """Record an immediate (not coalesced) answer: the guard only ever moves forward, and
    answers to one message each may finish out of order."""
    note_chats_answered(bot_id=bot_id, answered=[(chat_id, message_id)])


def note_chats_answered(*, bot_id: int, answered: list[tuple[int, int]]) -> None:
    """note_chat_answered for several (chat, message) answers of one bot: one statement,
    each chat's row made or moved forward to the newest message answered; committed
    asynchronously (core/rows.py): it is written before its runs' done mark, so a crash
    of PostgreSQL that loses it loses that mark too, and the runs write it again."""
    newest: dict[int, int] = {}
    for chat_id, message_id in answered:
        newest[chat_id] = max(message_id, newest.get(chat_id, message_id))
    if not newest:
        return
    now = timezone.now()
    rows.execute(sql.NOTE_CHATS_ANSWERED, [bot_id, now, now, list(newest), list(newest.values())], async_commit=True)
