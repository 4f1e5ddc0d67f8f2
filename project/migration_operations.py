"""Migration operations that run on PostgreSQL (production, tests) and on SQLite (`make demo`)."""

from __future__ import annotations

from typing import Any

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations


class AddIndexConcurrentlyOnPostgres(AddIndexConcurrently):
    """`CREATE INDEX CONCURRENTLY` on PostgreSQL, so that building an index on a table of
    millions of rows does not lock its writes; a plain `CREATE INDEX` elsewhere (the demo's
    SQLite, which has no such option). The migration must say `atomic = False`."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)
        else:
            migrations.AddIndex.database_forwards(self, app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)
        else:
            migrations.AddIndex.database_backwards(self, app_label, schema_editor, from_state, to_state)


def drop_indexes_concurrently(indexes: list[tuple[str, str, str]]) -> migrations.RunPython:
    """Drop these (table, column, index name) single-column indexes, `CONCURRENTLY` on
    PostgreSQL so writes go on meanwhile; backwards, build them again the same way. For
    indexes Django made by itself (a foreign key's), whose drop through the state would also
    drop and re-add the constraint. The migration must say `atomic = False`."""

    def concurrently(schema_editor: Any) -> str:
        return " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""

    def drop(apps: Any, schema_editor: Any) -> None:
        how = concurrently(schema_editor)
        for _, _, name in indexes:
            schema_editor.execute(f"DROP INDEX{how} IF EXISTS {schema_editor.quote_name(name)}")

    def create(apps: Any, schema_editor: Any) -> None:
        quote, how = schema_editor.quote_name, concurrently(schema_editor)
        for table, column, name in indexes:
            schema_editor.execute(f"CREATE INDEX{how} IF NOT EXISTS {quote(name)} ON {quote(table)} ({quote(column)})")

    return migrations.RunPython(drop, create)


def plain_index_only(indexes: list[tuple[str, str, str, str]]) -> migrations.RunPython:
    """For these (table, column, Django's db_index name, new name) text columns: drop the
    `varchar_pattern_ops` twin that `db_index=True` makes on PostgreSQL (`<name>_like`, for
    LIKE 'prefix%' lookups), `CONCURRENTLY`, and give the plain index its new name (a
    `Meta.indexes` entry's). On SQLite there is no twin, and an index cannot be renamed: it is
    built again under the new name. Backwards, the same undone. The migration must say
    `atomic = False`."""

    def forwards(apps: Any, schema_editor: Any) -> None:
        quote = schema_editor.quote_name
        for table, column, old, new in indexes:
            if schema_editor.connection.vendor == "postgresql":
                schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(old + '_like')}")
                schema_editor.execute(f"ALTER INDEX IF EXISTS {quote(old)} RENAME TO {quote(new)}")
            else:
                schema_editor.execute(f"DROP INDEX IF EXISTS {quote(old)}")
                schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {quote(new)} ON {quote(table)} ({quote(column)})")

    def backwards(apps: Any, schema_editor: Any) -> None:
        quote = schema_editor.quote_name
        for table, column, old, new in indexes:
            if schema_editor.connection.vendor == "postgresql":
                schema_editor.execute(f"ALTER INDEX IF EXISTS {quote(new)} RENAME TO {quote(old)}")
                schema_editor.execute(
                    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {quote(old + '_like')}"
                    f" ON {quote(table)} ({quote(column)} varchar_pattern_ops)"
                )
            else:
                schema_editor.execute(f"DROP INDEX IF EXISTS {quote(new)}")
                schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {quote(old)} ON {quote(table)} ({quote(column)})")

    return migrations.RunPython(forwards, backwards)
