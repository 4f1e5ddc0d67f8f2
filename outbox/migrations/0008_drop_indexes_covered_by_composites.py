"""Drop the foreign keys' own indexes that a composite index starting with the same column
already serves (a look by the key uses the composite). Each index costs every insert and
every state change of the table, on the hot path.

Only the indexes go (DROP INDEX CONCURRENTLY on PostgreSQL, so writes go on meanwhile): the
foreign key constraints stay as they are, unlike AlterField's database side, which would
drop and re-add each constraint and re-check every row of a large table."""

import django.db.models.deletion
from django.db import migrations, models

# (table, column, index) as Django named them when the foreign keys were created.
INDEXES = [
    ("outbox_attempt", "message_id", "outbox_attempt_message_id_0c8082e0"),
    ("outbox_outboundmessage", "bot_id", "outbox_outboundmessage_bot_id_a83cbdd0"),
]


def drop(apps, schema_editor):
    concurrently = " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    for _, _, name in INDEXES:
        schema_editor.execute(f"DROP INDEX{concurrently} IF EXISTS {schema_editor.quote_name(name)}")


def create(apps, schema_editor):
    concurrently = " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    quote = schema_editor.quote_name
    for table, column, name in INDEXES:
        schema_editor.execute(
            f"CREATE INDEX{concurrently} IF NOT EXISTS {quote(name)} ON {quote(table)} ({quote(column)})"
        )


class Migration(migrations.Migration):
    atomic = False  # CREATE/DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("bots", "0008_drop_indexes_covered_by_composites"),
        ("outbox", "0007_request_fingerprint"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
        migrations.AlterField(
            model_name='attempt',
            name='message',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='attempt_set', to='outbox.outboundmessage'),
        ),
        migrations.AlterField(
            model_name='outboundmessage',
            name='bot',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='outbound_messages', to='bots.bot'),
        ),
    ],
            database_operations=[migrations.RunPython(drop, create)],
        ),
    ]
