"""Thin Celery wrappers for the inbox: take an id, call one service."""

from celery import Task, shared_task

from bots import services


@shared_task(name="bots.route_update", ignore_result=True)
def route_update(update_pk: int) -> int:
    return len(services.inbox_update_route(update_pk))


@shared_task(name="bots.route_bot", ignore_result=True, bind=True)
def route_bot(self: Task, bot_id: int) -> int:
    # A worker's router lingers for the next update; one run eagerly (in-process) does not.
    return services.inbox_router_run(bot_id, linger=not self.request.is_eager)


@shared_task(name="bots.run_consumer", ignore_result=True)
def run_consumer(run_pk: int) -> str:
    return services.consumer_run_execute(run_pk)
