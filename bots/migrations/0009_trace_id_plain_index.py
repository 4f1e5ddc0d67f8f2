"""The trace id columns keep their plain index only: `db_index=True` on a CharField also built
a `varchar_pattern_ops` twin on PostgreSQL, for LIKE 'prefix%' lookups, which nothing makes
(every look by trace id is `=`), and every insert and state change of the table paid for it
(the hot path). The plain index is renamed to its `Meta.indexes` name, not rebuilt."""

from django.db import migrations, models

from core.migration_operations import plain_index_only

# (table, column, the index db_index made, its name as a Meta index)
INDEXES = [
    ("bots_inboundupdate", "trace_id", "bots_inboundupdate_trace_id_18ffba76", "inbox_trace_idx"),
    ("bots_consumerrun", "trace_id", "bots_consumerrun_trace_id_e2f2ef67", "run_trace_idx"),
]


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("bots", "0008_drop_indexes_covered_by_composites"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(model_name="consumerrun", name="trace_id", field=models.CharField(max_length=64)),
                migrations.AlterField(
                    model_name="inboundupdate", name="trace_id", field=models.CharField(max_length=64)
                ),
                migrations.AddIndex(
                    model_name="consumerrun", index=models.Index(fields=["trace_id"], name="run_trace_idx")
                ),
                migrations.AddIndex(
                    model_name="inboundupdate", index=models.Index(fields=["trace_id"], name="inbox_trace_idx")
                ),
            ],
            database_operations=[plain_index_only(INDEXES)],
        ),
    ]
