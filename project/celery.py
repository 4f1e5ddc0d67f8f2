"""The Celery application. Configuration lives in Django settings under CELERY_*."""

from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun

from project.failclosed import load_settings_or_exit

load_settings_or_exit()

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_prerun.connect(dispatch_uid="project.close_old_connections_before_task")
@task_postrun.connect(dispatch_uid="project.close_old_connections_after_task")
def close_old_connections(**kwargs: Any) -> None:
    """What Django does around a request: drop connections past CONN_MAX_AGE or broken
    (health checks), keep the rest. Celery's fixup would otherwise close them all around
    every task (settings.CELERY_DB_REUSE_MAX)."""
    if getattr(kwargs.get("task"), "request", None) is not None and kwargs["task"].request.is_eager:
        return
    from django.db import close_old_connections as django_close_old_connections

    django_close_old_connections()
