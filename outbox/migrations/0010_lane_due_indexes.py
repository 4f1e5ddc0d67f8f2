"""Each lane's queue of a bot by when each message falls due: the replies' (the drain's
claim) and the broadcasts' (the broadcast drain's claim, the sweeper's look for a lost one)."""

from django.db import migrations, models

from core.migration_operations import AddIndexConcurrentlyOnPostgres


class Migration(migrations.Migration):
    # Built without locking writes on a large table.
    atomic = False

    dependencies = [
        ("bots", "0009_trace_id_plain_index"),
        ("outbox", "0009_trace_id_plain_index"),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name="outboundmessage",
            index=models.Index(
                condition=models.Q(("broadcast", ""), ("state__in", ["pending", "retry"])),
                fields=["bot", "next_attempt_at"],
                name="outbox_reply_due_idx",
            ),
        ),
        AddIndexConcurrentlyOnPostgres(
            model_name="outboundmessage",
            index=models.Index(
                condition=models.Q(("state__in", ["pending", "retry"]), models.Q(("broadcast", ""), _negated=True)),
                fields=["bot", "next_attempt_at"],
                name="outbox_bulk_due_idx",
            ),
        ),
    ]
