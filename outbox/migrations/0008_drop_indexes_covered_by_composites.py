"""The outbox's foreign key indexes that a composite starting with the same column already
serves, dropped as bots.0008 drops the inbox's (the constraints stay)."""

import django.db.models.deletion
from django.db import migrations, models

from core.migration_operations import drop_indexes_concurrently

# (table, column, index) as Django named them when the foreign keys were created.
INDEXES = [
    ("outbox_attempt", "message_id", "outbox_attempt_message_id_0c8082e0"),
    ("outbox_outboundmessage", "bot_id", "outbox_outboundmessage_bot_id_a83cbdd0"),
]


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
            database_operations=[drop_indexes_concurrently(INDEXES)],
        ),
    ]
