"""Thin Celery wrappers for triage; they run on the bulk queue (CELERY_TASK_QUEUE_BULK)."""

from celery import shared_task

from reconciliation import triage


@shared_task(name="reconciliation.bulk_retry_tick", ignore_result=True)
def bulk_retry_tick(bulk_id: int, released: int | None = None) -> str:
    countdown = triage.bulk_retry_tick(bulk_id, expect_released=released)
    if countdown is None:
        return "finished"
    triage.bulk_retry_schedule(bulk_id, countdown=countdown)
    return "released"
