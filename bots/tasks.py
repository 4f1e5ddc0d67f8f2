"""Thin Celery wrappers for the inbox: take an id, call one service."""

from celery import Task, shared_task

from bots import routing, runs

# A router hands its worker back after its time budget (routing.ROUTE_TIME_BUDGET_SECONDS)
# and its inline sends wait for a slow Bot API only briefly: one still running after these
# is stuck (an inline consumer that hangs), and Celery ends it; the runs it held are taken
# over once their leases run out, and its wake-up key expires for the next router.
ROUTER_SOFT_TIME_LIMIT = 60
ROUTER_TIME_LIMIT = 90


@shared_task(
    name="bots.route_update", ignore_result=True, soft_time_limit=ROUTER_SOFT_TIME_LIMIT, time_limit=ROUTER_TIME_LIMIT
)
def route_update(update_pk: int) -> int:
    return len(routing.inbox_update_route(update_pk))


@shared_task(
    name="bots.route_bot",
    ignore_result=True,
    bind=True,
    soft_time_limit=ROUTER_SOFT_TIME_LIMIT,
    time_limit=ROUTER_TIME_LIMIT,
)
def route_bot(self: Task, bot_id: int) -> int:
    # A worker's router lingers for the next update; one run eagerly (in-process) does not.
    return routing.inbox_router_run(bot_id, linger=not self.request.is_eager)


@shared_task(name="bots.run_consumer", ignore_result=True)
def run_consumer(run_pk: int) -> str:
    return runs.consumer_run_execute(run_pk)
