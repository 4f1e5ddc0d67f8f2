"""The outbound message's trace id keeps its plain index only, as bots.0009 does for the
inbox's: no `varchar_pattern_ops` twin for every write to pay for."""

from django.db import migrations, models

from core.migration_operations import plain_index_only

INDEXES = [
    ("outbox_outboundmessage", "trace_id", "outbox_outboundmessage_trace_id_749bff3c", "outbox_trace_idx"),
]


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("outbox", "0008_drop_indexes_covered_by_composites"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="outboundmessage",
                    name="trace_id",
                    field=models.CharField(blank=True, help_text="Follows one update end to end.", max_length=64),
                ),
                migrations.AddIndex(
                    model_name="outboundmessage", index=models.Index(fields=["trace_id"], name="outbox_trace_idx")
                ),
            ],
            database_operations=[plain_index_only(INDEXES)],
        ),
    ]
