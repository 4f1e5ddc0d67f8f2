"""A worker's router lingers: out of updates, it waits with its bot's wake-up key for the
next one, which the webhook's wake-up nudges through Redis, so a steady stream is routed
without a publish and a worker's hop per update. It hands its worker back when the time
passes, when other tasks wait in the broker's queues, or when Redis fails; it never leaves
an update stored meanwhile without a router."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from bots import inbox, registry, routing
from bots.models import ConsumerRun, InboundUpdate, UpdateState
from core.publishing import publish
from tests.bots.fakes import message_update
from tests.bots.test_routing import forget_queued_tasks, queued_tasks, store, store_at_the_webhook
from tests.outbox.helpers import limiter_redis_at

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def inline_work(settings) -> None:
    """As in production: the echo reply and analytics run in the router's task, so routing
    queues no task of its own (one would make a lingering router hand its worker back)."""
    settings.DOVECOTE_INLINE_WORK = True


class Router(threading.Thread):
    """inbox_router_run as a worker's task runs it (lingering), in a thread of this test."""

    def __init__(self, bot_id: int) -> None:
        super().__init__(daemon=True)
        self.bot_id = bot_id
        self.routed: int | None = None
        self.seconds: float | None = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.routed = routing.inbox_router_run(self.bot_id, linger=True)
        finally:
            self.seconds = time.monotonic() - started
            connection.close()


def routed_updates(bot) -> int:
    return InboundUpdate.objects.filter(bot=bot, state=UpdateState.DONE).count()


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_a_lingering_router_routes_the_next_updates_on_their_nudges_without_a_task_for_them(bot, settings) -> None:
    settings.DOVECOTE_ROUTER_LINGER_SECONDS = 3.0
    store(bot, 1)
    forget_queued_tasks()  # a worker took the router task: this thread is that router
    router = Router(bot.pk)
    router.start()
    assert wait_for(lambda: routed_updates(bot) == 1)

    for n in range(2, 5):
        time.sleep(0.2)  # a pause between updates, as at a few updates a second
        store_at_the_webhook(bot, 1, chat_id=800 + n)
        assert wait_for(lambda n=n: routed_updates(bot) == n, timeout=2.0)
        assert queued_tasks() == []  # the nudge reached the lingering router: no task published
    assert router.is_alive()

    router.join(10)
    assert router.routed == 4
    assert 3.0 <= router.seconds < 6.0  # it let go a linger's time after the last update
    assert ConsumerRun.objects.filter(update__bot=bot).count() == 4 * len(
        registry.matching(InboundUpdate.objects.first())
    )

    # Gone, it no longer holds the key: the next update publishes a router again.
    store_at_the_webhook(bot, 1, chat_id=900)
    assert queued_tasks() == ["bots.route_bot"]


def test_a_lingering_router_hands_its_worker_back_when_another_task_waits_for_one(bot, settings) -> None:
    settings.DOVECOTE_ROUTER_LINGER_SECONDS = 30.0
    store(bot, 1)
    forget_queued_tasks()
    router = Router(bot.pk)
    router.start()
    assert wait_for(lambda: routed_updates(bot) == 1)
    time.sleep(0.2)
    assert router.is_alive()

    # Another task waits in the broker's queue for a worker (all of them busy).
    from bots.tasks import route_update

    assert publish(route_update, (0,), what="a task waiting for a worker")
    router.join(5)
    assert not router.is_alive()
    assert router.seconds < 5.0
    assert queued_tasks() == ["bots.route_update"]  # left to the worker it waits for

    # It let go of its key: the next update publishes a router.
    forget_queued_tasks()
    store_at_the_webhook(bot, 1, chat_id=901)
    assert queued_tasks() == ["bots.route_bot"]


def test_with_redis_failing_a_lingering_router_lets_go_at_once_and_loses_nothing(bot, settings) -> None:
    settings.DOVECOTE_ROUTER_LINGER_SECONDS = 30.0
    store(bot, 2)
    forget_queued_tasks()
    with limiter_redis_at("redis://127.0.0.1:9/0"):
        started = time.monotonic()
        assert routing.inbox_router_run(bot.pk, linger=True) == 2
        assert time.monotonic() - started < 10.0
    assert routed_updates(bot) == 2


def test_an_update_stored_as_a_lingering_router_gives_up_is_still_routed(bot, settings) -> None:
    # The router's linger ends while an update is being stored: whichever comes first, the
    # nudge, the router's look once more after letting go, or a new router task, routes it.
    settings.DOVECOTE_ROUTER_LINGER_SECONDS = 0.3
    for attempt in range(5):
        store(bot, 1, chat_id=1000 + attempt * 10)
        forget_queued_tasks()
        router = Router(bot.pk)
        router.start()
        time.sleep(0.3 + attempt * 0.01)
        inbox.inbox_update_store(
            bot=bot, payload=message_update(chat_id=1001 + attempt * 10, text="hi", message_id=1), wake_soon=True
        )
        assert routing.inbox_router_wakes_flush(timeout=10)
        router.join(10)
        if queued_tasks():
            assert queued_tasks() == ["bots.route_bot"]
            forget_queued_tasks()
            routing.inbox_router_run(bot.pk)  # the worker that takes the new task
        assert routed_updates(bot) == 2 * (attempt + 1)


def test_a_router_does_not_linger_when_it_cannot_see_the_brokers_queues(settings) -> None:
    settings.CELERY_BROKER_URL = "amqp://guest@127.0.0.1:5672//"
    assert routing._router_linger_queues() is None
    settings.CELERY_BROKER_URL = settings.REDIS_URL
    assert routing._router_linger_queues() is not None
    settings.DOVECOTE_ROUTER_LINGER_SECONDS = 0
    assert routing._router_linger_queues() is None
