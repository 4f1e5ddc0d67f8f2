"""Coalesced routing: a burst of updates at the webhook wakes one router task per bot (not a
task per update), the router routes the bot's new updates in batches, and nothing stored is
ever left without a router: a key held by a lost router expires, Redis failing falls back to
a task per update, and the sweeper still dispatches what is left."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
import redis
from django.conf import settings
from django.db import connection, transaction

from bots import inbox, routing
from bots.models import ConsumerRun, InboundUpdate, RunState, UpdateState
from core import wakeups
from outbox.models import OutboundMessage, State
from reconciliation.sweeper import sweep
from tests.bots.fakes import message_update
from tests.outbox.helpers import limiter_redis_at
from tests.support import in_threads, queued

pytestmark = pytest.mark.django_db(transaction=True)


def store(bot, n: int, *, chat_id: int = 500) -> None:
    """As the webhook does: each update in its own transaction, the wake-up after commit."""
    for i in range(n):
        with transaction.atomic():
            inbox.inbox_update_store(bot=bot, payload=message_update(chat_id=chat_id + i, text="hi", message_id=1))


def store_at_the_webhook(bot, n: int, *, chat_id: int = 700) -> None:
    """As the webhook view stores: the wake-up left to the process's wake-up thread, which
    has handed every one over when this returns."""
    for i in range(n):
        inbox.inbox_update_store(
            bot=bot, payload=message_update(chat_id=chat_id + i, text="hi", message_id=1), wake_soon=True
        )
    assert routing.inbox_router_wakes_flush(timeout=10)


def queued_tasks() -> list[str]:
    return [task.name for task in queued()]


def forget_queued_tasks() -> None:
    """A worker took the queued tasks (and this test runs them in-process)."""
    redis.Redis.from_url(settings.REDIS_URL).delete(
        f"{settings.DOVECOTE_REDIS_PREFIX}{settings.CELERY_TASK_DEFAULT_QUEUE}"
    )


def test_a_burst_of_updates_wakes_one_router_which_routes_them_all_in_batches(bot, monkeypatch) -> None:
    monkeypatch.setattr(routing, "ROUTE_BATCH_SIZE", 7)
    store(bot, 30)
    assert queued_tasks() == ["bots.route_bot"]
    assert queued()[0].args == [bot.pk]
    forget_queued_tasks()

    assert routing.inbox_router_run(bot.pk) == 30
    assert not InboundUpdate.objects.filter(state=UpdateState.NEW).exists()
    # Every update got its runs, once each. The router ran them (the echo and analytics are
    # inline-safe): no run went to the workers, and the replies it had no slot for wait for
    # the bot's drain.
    assert ConsumerRun.objects.count() == 30 * len(InboundUpdate.objects.first().runs.all())
    assert set(ConsumerRun.objects.values_list("state", flat=True)) == {RunState.DONE}
    assert OutboundMessage.objects.count() == 30
    # (Others may be `sending` still: their answers late, recorded by this process's thread.)
    waiting = OutboundMessage.objects.filter(state=State.PENDING).exists()
    assert queued_tasks() == (["outbox.drain_bot"] if waiting else [])


def test_the_router_lets_go_of_its_wake_up_when_done_so_the_next_update_wakes_one(bot) -> None:
    store(bot, 2)
    forget_queued_tasks()
    assert routing.inbox_router_run(bot.pk) == 2
    forget_queued_tasks()

    store(bot, 1, chat_id=900)
    assert queued_tasks() == ["bots.route_bot"]


def test_an_update_stored_while_the_router_still_holds_the_wake_up_is_routed_by_it(bot) -> None:
    # The router holds the key (it is running); an update stored now publishes nothing ...
    assert wakeups.take(wakeups.key("router", bot.pk))
    store(bot, 1)
    assert queued_tasks() == []
    # ... and the running router, finding it on its way out, routes it.
    assert routing.inbox_router_run(bot.pk) == 1
    assert InboundUpdate.objects.get().state == UpdateState.DONE


def test_with_the_key_store_down_each_update_gets_its_own_routing_task(bot) -> None:
    # Redis for keys unreachable while the broker works (RabbitMQ as the broker): no update
    # waits for the sweeper.
    with limiter_redis_at("redis://127.0.0.1:9/0"):
        store(bot, 3)
    assert queued_tasks() == ["bots.route_update"] * 3


def test_updates_left_by_a_lost_router_are_dispatched_by_the_sweeper(bot, settings) -> None:
    settings.DOVECOTE_REDISPATCH_GRACE_SECONDS = 0
    store(bot, 3)
    forget_queued_tasks()  # the router task is lost; its key still stands for a few seconds

    assert sweep()["updates_redispatched"] == 3
    assert queued_tasks() == ["bots.route_update"] * 3
    for task in queued():
        routing.inbox_update_route(*task.args)
    assert not InboundUpdate.objects.filter(state=UpdateState.NEW).exists()


def test_two_routers_of_one_bot_route_each_update_once(bot, monkeypatch) -> None:
    monkeypatch.setattr(routing, "ROUTE_BATCH_SIZE", 3)
    store(bot, 40)
    forget_queued_tasks()
    # Two routers at once (a continuation beside a new wake-up): SKIP LOCKED keeps them apart.
    routed = in_threads(2, lambda i: routing.inbox_router_run(bot.pk))

    assert sum(routed) == 40
    assert not InboundUpdate.objects.filter(state=UpdateState.NEW).exists()
    assert InboundUpdate.objects.filter(attempts=1).count() == 40  # each routed once
    runs = list(ConsumerRun.objects.values_list("update_id", "consumer"))
    assert len(runs) == len(set(runs))


def test_a_router_skips_the_updates_another_router_is_marking_and_never_waits_for_them(bot) -> None:
    # Two routers whose batches overlap: each marks what it can lock and leaves the rest to
    # the other. Before, a router waited on the other's row locks, and two of them locking
    # in different orders deadlocked (seen at 100 updates/s: PostgreSQL broke it after 1 s).
    store(bot, 3)
    forget_queued_tasks()
    middle = InboundUpdate.objects.order_by("pk")[1]
    params = connection.get_connection_params()
    with psycopg.connect(
        dbname=params["dbname"], user=params.get("user"), host=params.get("host"), port=params.get("port")
    ) as other:
        # As the other router's statement holds it, until its commit.
        other.execute("SELECT id FROM bots_inboundupdate WHERE id = %s FOR UPDATE", [middle.pk])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '5s'")  # a wait fails the test instead of hanging it
        try:
            started = time.monotonic()
            assert routing.inbox_updates_route(bot.pk) == 2
            assert time.monotonic() - started < 2
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        assert list(InboundUpdate.objects.filter(state=UpdateState.NEW).values_list("pk", flat=True)) == [middle.pk]
        assert not ConsumerRun.objects.filter(update=middle).exists()
        other.rollback()  # the other router failed: the update is still new, for the next router

    assert routing.inbox_updates_route(bot.pk) == 1
    assert InboundUpdate.objects.filter(attempts=1).count() == 3  # each routed once
    runs = list(ConsumerRun.objects.values_list("update_id", "consumer"))
    assert len(runs) == len(set(runs))
    assert {u for u, _ in runs} == set(InboundUpdate.objects.values_list("pk", flat=True))


def test_the_webhooks_wake_ups_leave_from_a_thread_and_a_burst_still_wakes_one_router(bot) -> None:
    store_at_the_webhook(bot, 30)
    assert queued_tasks() == ["bots.route_bot"]
    forget_queued_tasks()

    assert routing.inbox_router_run(bot.pk) == 30
    forget_queued_tasks()  # the runs' tasks
    store_at_the_webhook(bot, 1, chat_id=950)  # the router let go: the next update wakes one
    assert queued_tasks() == ["bots.route_bot"]


def test_with_the_key_store_down_the_webhooks_thread_gives_each_update_its_own_task(bot) -> None:
    with limiter_redis_at("redis://127.0.0.1:9/0"):
        store_at_the_webhook(bot, 3)
    assert queued_tasks() == ["bots.route_update"] * 3


def test_the_wake_up_thread_hands_over_every_item_once_in_few_rounds_and_outlives_a_failure() -> None:
    rounds: list[tuple[int, list[int]]] = []
    failed = []

    def wake_up(key: int, items: list[int]) -> None:
        if not failed:
            failed.append(items)
            raise RuntimeError("Redis went away")
        rounds.append((key, items))
        time.sleep(0.01)  # a round trip: what arrives meanwhile waits for the next round

    deferred = wakeups.Deferred(wake_up)
    deferred.add(1, 0)
    assert deferred.flush(timeout=5)
    assert failed == [[0]]  # the first round failed (logged); its item is the sweeper's

    for i in range(1, 301):
        deferred.add(1 + i % 2, i)
    assert deferred.flush(timeout=10)

    handed = sorted(item for _, items in rounds for item in items)
    assert handed == list(range(1, 301))
    assert all(item % 2 == key - 1 for key, items in rounds for item in items)
    assert len(rounds) < 100  # 300 items, a few rounds: not a round trip each


def test_a_quiet_process_wakes_in_the_callers_thread_and_a_busy_one_leaves_it_to_its_thread() -> None:
    rounds: list[list[int]] = []
    at_once: list[tuple[int, int]] = []
    answers = {2: True, 3: False, 4: None}  # done / hand it to the thread / Redis failed

    def wake_up(key: int, items: list[int]) -> None:
        rounds.append(items)
        time.sleep(0.005)

    def try_at_once(key: int, item: int) -> bool | None:
        at_once.append((threading.get_ident(), item))
        return answers.get(item, True)

    deferred = wakeups.Deferred(wake_up, at_once=try_at_once)
    deferred.add(1, 1)  # its thread is not running yet
    assert deferred.flush(timeout=5)
    time.sleep(0.05)  # quiet: the thread waits, and nothing came for a while
    for item in (2, 3):
        deferred.add(1, item)
        assert deferred.flush(timeout=5)
        time.sleep(0.05)
    assert at_once == [(threading.get_ident(), 2), (threading.get_ident(), 3)]  # in this thread
    assert sorted(i for r in rounds for i in r) == [1, 3]  # 2 needed nothing more

    # A burst: items close together go to the thread, a round for many.
    for item in range(100, 160):
        deferred.add(1, item)
    assert deferred.flush(timeout=10)
    assert [i for _, i in at_once if i >= 100] == [100]  # the first, in a quiet process
    assert sorted(i for r in rounds for i in r if i >= 100) == list(range(101, 160))

    # Redis failed in the request: the thread has this item and the next quiet ones.
    time.sleep(0.05)
    before = len(at_once)
    deferred.add(1, 4)
    for item in (5, 6):
        assert deferred.flush(timeout=5)
        time.sleep(0.05)
        deferred.add(1, item)
    assert deferred.flush(timeout=5)
    assert [i for _, i in at_once[before:]] == [4]
    assert {4, 5, 6} <= {i for r in rounds for i in r}


def test_a_quiet_webhook_nudges_the_router_holding_the_key_before_its_request_returns(bot, monkeypatch) -> None:
    monkeypatch.setattr(routing._router_wake_soon, "_at_once_after", 0.0)  # an earlier test's Redis failure
    store_at_the_webhook(bot, 1)  # no router: the thread publishes one, which holds the key
    assert queued_tasks() == ["bots.route_bot"]
    forget_queued_tasks()
    nudges = wakeups.nudges_key(routing._router_key(bot.pk))
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(nudges)
    time.sleep(0.05)

    inbox.inbox_update_store(bot=bot, payload=message_update(chat_id=960, text="hi", message_id=1), wake_soon=True)
    # No flush: the nudge left with the request, one round trip, no publish.
    assert client.llen(nudges) == 1
    assert routing.inbox_router_wakes_flush(timeout=10)
    assert queued_tasks() == []
    assert routing.inbox_router_run(bot.pk) == 2  # the router that held the key routes both


def test_with_redis_failing_a_quiet_webhook_tries_it_in_the_request_once_then_leaves_it_to_the_thread(
    bot, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(routing._router_wake_soon, "_at_once_after", 0.0)
    store_at_the_webhook(bot, 1)  # the thread is running
    forget_queued_tasks()
    with limiter_redis_at("redis://127.0.0.1:9/0"):
        for i in range(3):
            time.sleep(0.05)
            inbox.inbox_update_store(
                bot=bot, payload=message_update(chat_id=970 + i, text="hi", message_id=1), wake_soon=True
            )
            assert routing.inbox_router_wakes_flush(timeout=10)
    assert len([r for r in caplog.records if r.getMessage().startswith("could not nudge")]) == 1
    assert queued_tasks() == ["bots.route_update"] * 3  # each still got its task, from the thread


def test_the_routers_read_gives_the_updates_their_bot_and_circuits_as_the_queryset_would(bot, bot_factory) -> None:
    from bots import transitions
    from outbox.models import Circuit, CircuitState

    other = bot_factory(name="other")
    store(bot, 3)
    store(other, 1)
    InboundUpdate.objects.filter(pk=InboundUpdate.objects.filter(bot=bot).order_by("pk")[0].pk).update(
        state=UpdateState.DONE
    )
    Circuit.objects.create(scope="consumer:auto_reply", state=CircuitState.OPEN, consecutive_failures=3)
    Circuit.objects.create(scope="consumer:analytics", state=CircuitState.CLOSED, consecutive_failures=0)
    scopes = ["consumer:analytics", "consumer:auto_reply", "consumer:crm"]

    read = transitions.updates_to_route(bot_id=bot.pk, limit=50, circuits=scopes)
    expected = list(InboundUpdate.objects.select_related("bot").filter(bot=bot, state=UpdateState.NEW).order_by("pk"))
    assert len(read) == 2
    assert [u.pk for u in read] == [u.pk for u in expected]
    fields = [f.attname for f in InboundUpdate._meta.concrete_fields]
    bot_fields = [f.attname for f in type(bot)._meta.concrete_fields]
    for got, want in zip(read, expected, strict=True):
        assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
        assert isinstance(got.payload, dict)
        assert got.payload["message"]["text"] == "hi"
        assert {f: getattr(got.bot, f) for f in bot_fields} == {f: getattr(want.bot, f) for f in bot_fields}
        assert got.unsettled_circuits == ["consumer:auto_reply"]
        assert not got._state.adding
        assert got._state.db == "default"

    assert len(transitions.updates_to_route(bot_id=bot.pk, limit=1)) == 1
    assert not hasattr(transitions.updates_to_route(bot_id=bot.pk, limit=1)[0], "unsettled_circuits")
    one = expected[1].pk
    assert [u.pk for u in transitions.updates_to_route(update_pk=one, limit=1)] == [one]
    assert transitions.updates_to_route(update_pk=InboundUpdate.objects.get(state=UpdateState.DONE).pk, limit=1) == []
