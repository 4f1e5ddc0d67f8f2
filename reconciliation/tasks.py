from celery import shared_task

from reconciliation import sweeper


@shared_task(name="reconciliation.sweep", ignore_result=True)
def sweep() -> dict[str, int]:
    return sweeper.sweep()
