"""Migration operations that change indexes without locking the tables' writes."""

from __future__ import annotations

from typing import Any

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations


class AddIndexConcurrentlyOnPostgres(AddIndexConcurrently):
    """`CREATE INDEX CONCURRENTLY`, so that building an index on a table of millions of rows
    does not lock its writes. Django's own operation, under the name the migrations use. The
    migration must say `atomic = False`."""


def drop_indexes_concurrently(indexes: list[tuple[str, str, str]]) -> migrations.RunPython:
    """Drop these (table, column, index name) single-column indexes `CONCURRENTLY`, so writes
    go on meanwhile; backwards, build them again the same way. For indexes Django made by
    itself (a foreign key's), whose drop through the state would also drop and re-add the
    constraint. The migration must say `atomic = False`."""

    def drop(apps: Any, schema_editor: Any) -> None:
        for _, _, name in indexes:
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(name)}")

    def create(apps: Any, schema_editor: Any) -> None:
        quote = schema_editor.quote_name
        for table, column, name in indexes:
            schema_editor.execute(
                f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {quote(name)} ON {quote(table)} ({quote(column)})"
            )

    return migrations.RunPython(drop, create)


def plain_index_only(indexes: list[tuple[str, str, str, str]]) -> migrations.RunPython:
    """For these (table, column, Django's db_index name, new name) text columns: drop the
    `varchar_pattern_ops` twin that `db_index=True` makes (`<name>_like`, for LIKE 'prefix%'
    lookups), `CONCURRENTLY`, and give the plain index its new name (a `Meta.indexes`
    entry's). Backwards, the same undone. The migration must say `atomic = False`."""

    def forwards(apps: Any, schema_editor: Any) -> None:
        quote = schema_editor.quote_name
        for _, _, old, new in indexes:
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(old + '_like')}")
            schema_editor.execute(f"ALTER INDEX IF EXISTS {quote(old)} RENAME TO {quote(new)}")

    def backwards(apps: Any, schema_editor: Any) -> None:
        quote = schema_editor.quote_name
        for table, column, old, new in indexes:
            schema_editor.execute(f"ALTER INDEX IF EXISTS {quote(new)} RENAME TO {quote(old)}")
            schema_editor.execute(
                f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {quote(old + '_like')}"
                f" ON {quote(table)} ({quote(column)} varchar_pattern_ops)"
            )

    return migrations.RunPython(forwards, backwards)
