"""Worker-side trace hygiene: every Celery task starts and ends with no trace id, so a log
line can never carry the previous task's trace (prefork children run many tasks). The
services set the trace id of the row they load (update, run, message) first thing."""

from __future__ import annotations

from typing import Any

from celery.signals import task_postrun, task_prerun, worker_process_shutdown

from core.logs import current_trace_id


@task_prerun.connect(dispatch_uid="bots.clear_trace_before_task")
def clear_trace_before_task(**kwargs: Any) -> None:
    current_trace_id.set("")


@task_postrun.connect(dispatch_uid="bots.clear_trace_after_task")
def clear_trace_after_task(**kwargs: Any) -> None:
    current_trace_id.set("")


@worker_process_shutdown.connect(dispatch_uid="bots.finish_awaiting_runs")
def finish_awaiting_runs(**kwargs: Any) -> None:
    """A worker process stopping (SIGTERM, a deploy) lets its event loop's runs finish, up to
    the soft shutdown's time: each then settles its own row. Those still running after it
    are taken over by the sweeper once their leases run out, as a killed worker's are."""
    from django.conf import settings

    from bots import aio

    if aio.in_flight():
        aio.wait_idle(settings.CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT)
