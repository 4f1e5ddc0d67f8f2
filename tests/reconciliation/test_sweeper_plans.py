"""The sweeper stays cheap on millions of rows: each of its queries is served by a partial
index over the few live rows, never a scan of the (mostly sent) table. PostgreSQL's
planner is told seq scans are off - so a query with no usable index shows a Seq Scan - and
each plan must name the expected index."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from bots import retention as bot_retention
from bots.models import ChatState, ConsumerRun, InboundUpdate, RunState, UpdateState
from outbox import retention
from outbox.models import Effect, EffectState, OutboundMessage, State
from reconciliation import sweeper
from reconciliation.retention import case_kept_exists
from tests.reconciliation.factories import message_row, stored_update

NOW = timezone.now()
# Every history row is older than this: retention's queries see a table of prunable rows.
LATER = NOW + timedelta(days=1)
ROWS = 3000

PLANS: list[tuple[str, Callable[[], Any], str, str]] = [
    ("unrouted updates", lambda: sweeper.updates_unrouted_qs(NOW), "next_attempt_at", "inbox_due_idx"),
    (
        "expired run leases",
        lambda: sweeper.runs_expired_qs(NOW),
        "lease_expires_at",
        "run_lease_idx|run_unfinished_idx",
    ),
    ("due runs", lambda: sweeper.runs_due_qs(NOW), "next_attempt_at", "run_due_idx"),
    ("runs past max age", lambda: sweeper.runs_too_old_qs("auto_reply", NOW), "next_attempt_at", "run_due_idx"),
    (
        "stuck sends",
        lambda: sweeper.messages_stuck_qs(NOW),
        "lease_expires_at",
        "outbox_lease_idx|outbox_open_chat_idx",
    ),
    ("expired messages", lambda: sweeper.messages_expired_qs(NOW), "next_attempt_at", "outbox_due_idx"),
    ("due messages", lambda: sweeper.messages_due_qs(NOW), "next_attempt_at", "outbox_due_idx"),
    (
        "unknown messages to resend",
        lambda: sweeper.messages_to_auto_resend_qs(NOW),
        "updated_at",
        "outbox_state_updated_idx",
    ),
    ("prunable effects", lambda: retention.effects_prunable_qs(LATER), "created_at", "effect_created_idx"),
    (
        "prunable sent messages",
        lambda: retention.messages_prunable_qs(State.SENT, LATER, reconciliation_keep(LATER)),
        "updated_at",
        "outbox_state_updated_idx",
    ),
    (
        "prunable failed messages",
        lambda: retention.messages_prunable_qs(State.FAILED, LATER, reconciliation_keep(LATER)),
        "updated_at",
        "outbox_state_updated_idx",
    ),
    ("payloads to purge", lambda: retention.payloads_purgeable_qs(LATER), "sent_at", "outbox_purge_idx"),
    (
        "inbound payloads to purge",
        lambda: bot_retention.payloads_purgeable_qs(LATER),
        "received_at",
        "inbox_purge_idx",
    ),
    (
        "prunable updates",
        lambda: bot_retention.updates_prunable_qs(LATER, middle_update_id()),
        "pk",
        "bots_inboundupdate_pkey",
    ),
    (
        "prunable updates with failed runs",
        lambda: bot_retention.updates_failed_prunable_qs(LATER, middle_update_id()),
        "pk",
        "bots_inboundupdate_pkey",
    ),
    (
        "prunable chat states",
        lambda: bot_retention.chat_states_prunable_qs(LATER),
        "updated_at",
        "chatstate_updated_idx",
    ),
    ("prunable API keys", lambda: retention.idempotency_prunable_qs(LATER), "created_at", "idempotency_created_idx"),
    ("stalled bulk retries", lambda: sweeper.bulk_retries_stalled_qs(NOW), "ticked_at", "bulkretry_running_idx"),
]


def middle_update_id() -> int:
    """A boundary (see outbox.retention.boundary_id) half way through the inbox."""
    ids = InboundUpdate.objects.order_by("pk").values_list("pk", flat=True)
    return ids[ROWS // 2]


def reconciliation_keep(now: Any) -> list:
    return [case_kept_exists("message", now), *bot_retention.keep_messages()]


def clone_rows(model: Any, template_pk: int, n: int, overrides: dict[str, str]) -> None:
    """INSERT ... SELECT generate_series: n copies of one row, some columns rewritten."""
    table = model._meta.db_table
    columns = [f.column for f in model._meta.concrete_fields if not f.primary_key]
    values = [overrides.get(c, f'"{c}"') for c in columns]
    with connection.cursor() as cursor:
        cursor.execute(
            f'INSERT INTO "{table}" ({", ".join(chr(34) + c + chr(34) for c in columns)}) '
            f'SELECT {", ".join(values)} FROM "{table}", generate_series(1, %s) AS g WHERE "{table}".id = %s',
            [n, template_pk],
        )
        cursor.execute(f'ANALYZE "{table}"')


@pytest.fixture
def history(bot) -> None:
    """Tables the way they look after a while: thousands of finished rows, none waiting."""
    update = stored_update(bot)
    InboundUpdate.objects.filter(pk=update.pk).update(state=UpdateState.DONE)
    clone_rows(InboundUpdate, update.pk, ROWS, {"update_id": "g + 100000000"})
    run = ConsumerRun.objects.create(
        update=update, bot=bot, consumer="auto_reply", state=RunState.DONE, next_attempt_at=NOW
    )
    clone_rows(
        ConsumerRun,
        run.pk,
        ROWS,
        {"update_id": "(SELECT min(id) FROM bots_inboundupdate) + g", "consumer": "'auto_reply'"},
    )
    sent = message_row(bot, state=State.SENT)
    clone_rows(OutboundMessage, sent.pk, ROWS, {"idempotency_key": "'hist-' || g"})
    failed = message_row(bot, key="failed", state=State.FAILED)
    clone_rows(OutboundMessage, failed.pk, ROWS, {"idempotency_key": "'hist-failed-' || g"})
    chat = ChatState.objects.create(bot=bot, chat_id=1)
    clone_rows(ChatState, chat.pk, ROWS, {"chat_id": "g + 1"})
    effect = Effect.objects.create(key="eff:hist", state=EffectState.DONE)
    clone_rows(Effect, effect.pk, ROWS, {"key": "'eff:hist:' || g"})


def test_every_sweeper_query_uses_a_partial_index_not_a_table_scan(history: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
    wrong = {}
    for what, query, order, indexes in PLANS:
        plan = query().order_by(order).values_list("pk", flat=True)[: sweeper.BATCH].explain()
        if "Seq Scan" in plan or not any(index in plan for index in indexes.split("|")):
            wrong[what] = plan
    wanted = {p[0]: p[3] for p in PLANS}
    assert not wrong, "\n\n".join(f"{what} (want {wanted[what]}):\n{plan}" for what, plan in wrong.items())


def test_the_due_messages_of_one_bot_use_an_index(history: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
    plan = sweeper.messages_due_qs(NOW, bot_id=1).order_by("next_attempt_at").values_list("pk")[:10].explain()
    assert "Seq Scan" not in plan, plan
    assert "outbox_due_idx" in plan or "outbox_open_chat_idx" in plan, plan


def test_the_sweepers_looks_for_broadcasts_use_an_index_of_waiting_rows(history: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
    for plan in (sweeper.broadcasts_overdue_bots_qs(NOW).explain(), sweeper.broadcasts_upcoming_qs(NOW).explain()):
        assert "Seq Scan" not in plan, plan
        assert "outbox_bulk_due_idx" in plan or "outbox_due_idx" in plan, plan
