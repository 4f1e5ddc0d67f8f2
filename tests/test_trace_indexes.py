"""The hot tables' trace ids have one plain index each (bots.0009, outbox.0009): a look by
trace id uses it, and no `varchar_pattern_ops` twin costs every write. Undone and redone,
the migrations leave the indexes as they found them."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from bots.models import ConsumerRun, InboundUpdate
from outbox.models import OutboundMessage

pytestmark = pytest.mark.django_db(transaction=True)

TABLES = {
    "bots_inboundupdate": "inbox_trace_idx",
    "bots_consumerrun": "run_trace_idx",
    "outbox_outboundmessage": "outbox_trace_idx",
}


def trace_indexes() -> dict[str, list[str]]:
    """Each hot table's indexes on trace_id, as `name: definition`."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE tablename = ANY(%s) AND indexdef LIKE %s"
            " ORDER BY indexname",
            [list(TABLES), "%(trace_id%"],
        )
        found: dict[str, list[str]] = {table: [] for table in TABLES}
        for table, name, definition in cursor.fetchall():
            found[table].append(f"{name}: {definition.split(' USING ')[1]}")
        return found


def migrate(targets: list[tuple[str, str]]) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


def test_each_hot_table_has_one_plain_trace_id_index_that_a_look_by_trace_id_uses() -> None:
    assert trace_indexes() == {table: [f"{name}: btree (trace_id)"] for table, name in TABLES.items()}
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
    try:
        for model, name in [(InboundUpdate, "inbox_trace_idx"), (ConsumerRun, "run_trace_idx")]:
            plan = model.objects.filter(trace_id="abc").explain()
            assert name in plan, plan
        plan = OutboundMessage.objects.filter(trace_id="abc").explain()
        assert "outbox_trace_idx" in plan, plan
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET enable_seqscan")


def test_the_migrations_undone_bring_back_both_indexes_and_redone_leave_the_plain_one() -> None:
    try:
        migrate(
            [("bots", "0008_drop_indexes_covered_by_composites"), ("outbox", "0008_drop_indexes_covered_by_composites")]
        )
        before = trace_indexes()
        assert [len(indexes) for indexes in before.values()] == [2, 2, 2], before
        assert all(any("varchar_pattern_ops" in index for index in indexes) for indexes in before.values()), before
    finally:
        migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    assert trace_indexes() == {table: [f"{name}: btree (trace_id)"] for table, name in TABLES.items()}
