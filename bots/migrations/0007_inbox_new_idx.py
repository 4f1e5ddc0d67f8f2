from django.db import migrations, models

from core.migration_operations import AddIndexConcurrentlyOnPostgres


class Migration(migrations.Migration):
    # Built without locking writes on a table of millions of rows.
    atomic = False

    dependencies = [
        ("bots", "0006_inbox_without_processing"),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name="inboundupdate",
            index=models.Index(fields=["bot", "id"], name="inbox_new_idx", condition=models.Q(state="new")),
        ),
    ]
