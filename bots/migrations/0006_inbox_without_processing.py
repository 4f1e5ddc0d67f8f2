"""The inbox's `processing` and `failed` states were never entered: an update is routed (its
runs written) in the transaction that makes it `done`. Rows an older version may have left
in them go back to `new` (routing again is harmless: one run per update and consumer). The
lease columns that went with `processing` leave the model now and the table later: during a
deploy the old web processes still insert them, so the table keeps them (lease_owner gets a
default, for the new code's inserts without it) until a later release drops them."""

from typing import Any

from django.db import migrations, models
from django.db.models.functions import Now


def states_back_to_new(apps: Any, schema_editor: Any) -> None:
    InboundUpdate = apps.get_model("bots", "InboundUpdate")
    InboundUpdate.objects.filter(state__in=["processing", "failed"]).update(state="new", next_attempt_at=Now())


def leases_out_of_the_model(apps: Any, schema_editor: Any) -> None:
    table = schema_editor.quote_name("bots_inboundupdate")
    schema_editor.execute(f"ALTER TABLE {table} ALTER COLUMN lease_owner SET DEFAULT ''")


def leases_back_in_the_model(apps: Any, schema_editor: Any) -> None:
    table = schema_editor.quote_name("bots_inboundupdate")
    schema_editor.execute(f"ALTER TABLE {table} ALTER COLUMN lease_owner DROP DEFAULT")


class Migration(migrations.Migration):
    dependencies = [
        ("bots", "0005_ops_chat"),
    ]

    operations = [
        migrations.RunPython(states_back_to_new, migrations.RunPython.noop),
        migrations.RemoveIndex(model_name="inboundupdate", name="inbox_lease_idx"),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(leases_out_of_the_model, leases_back_in_the_model)],
            state_operations=[
                migrations.RemoveField(model_name="inboundupdate", name="lease_owner"),
                migrations.RemoveField(model_name="inboundupdate", name="lease_expires_at"),
            ],
        ),
        migrations.AlterField(
            model_name="inboundupdate",
            name="state",
            field=models.CharField(choices=[("new", "new"), ("done", "done (routed to consumers)")], default="new", max_length=16),
        ),
    ]
