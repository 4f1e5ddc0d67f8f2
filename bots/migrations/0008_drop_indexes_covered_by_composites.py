"""Drop the foreign keys' own indexes that a composite index starting with the same column
already serves (a look by the key uses the composite). Each index costs every insert and
every state change of the table, on the hot path.

Only the indexes go (DROP INDEX CONCURRENTLY on PostgreSQL, so writes go on meanwhile): the
foreign key constraints stay as they are, unlike AlterField's database side, which would
drop and re-add each constraint and re-check every row of a large table."""

import django.db.models.deletion
from django.db import migrations, models

from core.migration_operations import drop_indexes_concurrently

# (table, column, index) as Django named them when the foreign keys were created.
INDEXES = [
    ("bots_analyticsevent", "bot_id", "bots_analyticsevent_bot_id_18e7f769"),
    ("bots_chatstate", "bot_id", "bots_chatstate_bot_id_2ddf198e"),
    ("bots_consumerrun", "update_id", "bots_consumerrun_update_id_a7a7e50c"),
    ("bots_inboundupdate", "bot_id", "bots_inboundupdate_bot_id_eaa5931f"),
]


class Migration(migrations.Migration):
    atomic = False  # CREATE/DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("bots", "0007_inbox_new_idx"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='analyticsevent',
                    name='bot',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='analytics_events', to='bots.bot'),
                ),
                migrations.AlterField(
                    model_name='chatstate',
                    name='bot',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='chat_states', to='bots.bot'),
                ),
                migrations.AlterField(
                    model_name='consumerrun',
                    name='update',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='runs', to='bots.inboundupdate'),
                ),
                migrations.AlterField(
                    model_name='inboundupdate',
                    name='bot',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='updates', to='bots.bot'),
                ),
            ],
            database_operations=[drop_indexes_concurrently(INDEXES)],
        ),
    ]
