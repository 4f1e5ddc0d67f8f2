"""Schedule the sweeper in django-celery-beat's DatabaseScheduler, so `beat` needs no
manual set-up. The interval comes from DOVECOTE_SWEEP_INTERVAL_SECONDS at migrate time
and can be changed in the admin (Periodic tasks)."""

from django.conf import settings
from django.db import migrations

TASK_NAME = "dovecote: sweeper"


def schedule(apps, schema_editor):  # noqa: ANN001, ANN201
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    interval, _ = IntervalSchedule.objects.get_or_create(
        every=settings.DOVECOTE_SWEEP_INTERVAL_SECONDS, period="seconds"
    )
    PeriodicTask.objects.update_or_create(
        name=TASK_NAME,
        defaults={
            "task": "reconciliation.sweep",
            "interval": interval,
            "enabled": True,
            # A sweep that waited longer than its interval is superseded by the next one.
            "expire_seconds": settings.DOVECOTE_SWEEP_INTERVAL_SECONDS,
            "description": "Recovers expired leases, lost broker messages and stale work.",
        },
    )


def unschedule(apps, schema_editor):  # noqa: ANN001, ANN201
    apps.get_model("django_celery_beat", "PeriodicTask").objects.filter(name=TASK_NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("reconciliation", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(schedule, unschedule)]
