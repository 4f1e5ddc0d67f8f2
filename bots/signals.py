"""Worker-side trace hygiene: every Celery task starts and ends with no trace id, so a log
line can never carry the previous task's trace (prefork children run many tasks). The
services set the trace id of the row they load (update, run, message) first thing."""

from __future__ import annotations

from typing import Any

from celery.signals import task_postrun, task_prerun

from outbox.logs import current_trace_id


@task_prerun.connect(dispatch_uid="bots.clear_trace_before_task")
def clear_trace_before_task(**kwargs: Any) -> None:
    current_trace_id.set("")


@task_postrun.connect(dispatch_uid="bots.clear_trace_after_task")
def clear_trace_after_task(**kwargs: Any) -> None:
    current_trace_id.set("")
