"""Thin Celery wrappers for the inbox: take an id, call one service."""

from celery import shared_task

from bots import services


@shared_task(name="bots.route_update", ignore_result=True)
def route_update(update_pk: int) -> int:
    return len(services.inbox_update_route(update_pk))


@shared_task(name="bots.route_bot", ignore_result=True)
def route_bot(bot_id: int) -> int:
    return services.inbox_router_run(bot_id)


@shared_task(name="bots.run_consumer", ignore_result=True)
def run_consumer(run_pk: int) -> str:
    return services.consumer_run_execute(run_pk)
