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
