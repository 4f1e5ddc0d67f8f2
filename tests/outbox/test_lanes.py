"""Two lanes: replies before broadcasts. A broadcast is written in one statement and sent by
its bot's broadcast drain on the bulk queue (no task per message), taking the bot's rate
only while no reply waits for it; the sweeper wakes that drain, never the interactive queue,
for broadcast messages. Real PostgreSQL, Redis, a worker process where it says so, and the
sandbox over HTTP with its limits enforced strictly."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from core import wakeups
from outbox import services
from outbox.models import DeadLetter, ErrorClass, OutboundMessage, State
from outbox.sending import batch
from reconciliation.sweeper import sweep
from tests.outbox.test_delivery_rules import warm_up
from tests.support import queued, wait_until


def bulk_queue() -> list[tuple[str, list]]:
    return [(task.name, task.args) for task in queued(settings.CELERY_TASK_QUEUE_BULK)]


def broadcast(bot, chats: list[int], *, key: str = "news", text: str = "news", **kw) -> list[int]:
    return services.broadcast_enqueue(
        bot_id=bot.pk, chat_ids=chats, payload={"text": text}, broadcast_key=key, **kw
    ).message_ids


def drain_until_done(*, timeout: float = 30.0) -> batch.DrainReport:
    """Play the bulk queue's worker in-process: run each task it holds at its time (the
    drains' continuations and timers land there too) until it holds none."""
    from outbox import ratelimit

    total = batch.DrainReport()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks = queued(settings.CELERY_TASK_QUEUE_BULK)
        if not tasks:
            return total
        ratelimit.redis_client().delete(f"{settings.DOVECOTE_REDIS_PREFIX}{settings.CELERY_TASK_QUEUE_BULK}")
        for task in sorted(tasks, key=lambda t: t.eta or ""):
            if task.eta:
                time.sleep(max(0.0, (datetime.fromisoformat(task.eta) - timezone.now()).total_seconds()))
            report = batch.outbound_broadcasts_drain(*task.args, **task.kwargs)
            total.sent += report.sent
            total.failed += report.failed
            total.cancelled += report.cancelled
    raise AssertionError(f"the bulk queue still had work after {timeout}s: {total}")


def states(ids: list[int]) -> dict[str, int]:
    found: dict[str, int] = {}
    for state in OutboundMessage.objects.filter(pk__in=ids).values_list("state", flat=True):
        found[state] = found.get(state, 0) + 1
    return found


@pytest.mark.e2e
def test_a_reply_written_while_a_broadcast_goes_out_is_sent_before_the_rest_of_the_broadcast(
    worker, bot_factory, sandbox
) -> None:
    bot = bot_factory(rate_limit=5)
    sandbox.limits(per_bot_per_second=5, per_private_chat_per_second=1)
    warm_up(bot)
    chats = list(range(5000, 5020))  # four seconds of the bot's rate
    broadcast(bot, chats, text="Our summer sale starts now")
    wait_until(lambda: len(sandbox.calls(token=bot.token, method="sendMessage")) >= 4, timeout=30)

    # Alice, one of the broadcast's chats, asks something: her answer is not held behind
    # the sixteen notifications still to go.
    services.outbound_message_enqueue(
        bot_id=bot.pk, chat_id=chats[-1], payload={"text": "Your order ships today"}, idempotency_key="alice"
    )
    wait_until(lambda: OutboundMessage.objects.filter(bot=bot).exclude(state=State.SENT).count() == 0, timeout=60)

    calls = sandbox.calls(token=bot.token, method="sendMessage")
    texts = [call["params"]["text"] for call in calls]
    assert sorted(texts) == ["Our summer sale starts now"] * 20 + ["Your order ships today"]  # each once
    after_the_reply = texts[texts.index("Your order ships today") + 1 :]
    assert len(after_the_reply) >= 10, texts
    assert [call for call in calls if call["status"] == 429] == []  # the sandbox's strict limits held


@pytest.mark.django_db(transaction=True)
def test_a_broadcast_is_one_wake_up_of_its_bots_broadcast_drain_not_a_task_per_message(bot) -> None:
    ids = broadcast(bot, list(range(1, 501)))

    assert len(ids) == 500
    assert queued() == []  # nothing on the queue of routers and replies
    assert bulk_queue() == [("outbox.drain_broadcasts", [bot.pk])]
    # The same broadcast again (a client's retry) writes and wakes nothing.
    assert broadcast(bot, list(range(1, 501))) == ids
    assert bulk_queue() == [("outbox.drain_broadcasts", [bot.pk])]


@pytest.mark.django_db(transaction=True)
def test_a_broadcast_drain_sends_each_chat_once_within_the_bots_limits(bot_factory, sandbox) -> None:
    bot = bot_factory(rate_limit=10)
    sandbox.limits(per_bot_per_second=10, per_private_chat_per_second=1, arrival_jitter_ms=5)
    warm_up(bot)
    ids = broadcast(bot, list(range(100, 130)))

    report = drain_until_done()

    assert report.sent == 30
    assert states(ids) == {State.SENT: 30}
    calls = sandbox.calls(token=bot.token, method="sendMessage")
    assert sorted(call["chat_id"] for call in calls) == list(range(100, 130))
    assert [call for call in calls if call["status"] == 429] == []
    # Nothing else was queued for them: the drain came back by its own continuations.
    assert queued() == []


@pytest.mark.django_db(transaction=True)
def test_a_broadcast_cancelled_midway_sends_nothing_more(bot_factory, sandbox) -> None:
    bot = bot_factory(rate_limit=2)
    ids = broadcast(bot, list(range(200, 210)))
    first = batch.outbound_broadcasts_drain(bot.pk)  # its first quarter second: one message
    assert first.sent >= 1

    cancelled = services.outbound_broadcast_cancel(bot_id=bot.pk, broadcast="news", reason="sent by mistake")

    assert drain_until_done().sent == 0
    assert cancelled == 10 - first.sent
    assert states(ids) == {State.SENT: first.sent, State.CANCELLED: cancelled}
    assert len(sandbox.calls(token=bot.token, method="sendMessage")) == first.sent


@pytest.mark.django_db(transaction=True)
def test_a_broadcast_past_its_expiry_is_cancelled_not_sent(bot, sandbox) -> None:
    ids = broadcast(bot, [301, 302, 303], expires_at=timezone.now() + timedelta(seconds=1))
    OutboundMessage.objects.filter(pk__in=ids).update(expires_at=timezone.now() - timedelta(seconds=1))

    report = drain_until_done()

    assert (report.sent, report.cancelled) == (0, 3)
    assert set(OutboundMessage.objects.filter(pk__in=ids).values_list("state", "last_error_class")) == {
        (State.CANCELLED, ErrorClass.EXPIRED)
    }
    assert sandbox.calls(token=bot.token, method="sendMessage") == []


@pytest.mark.django_db(transaction=True)
@override_settings(DOVECOTE_RETRY_BASE_SECONDS=0.3, DOVECOTE_RETRY_MAX_SECONDS=0.6)
def test_a_broadcast_drain_dead_letters_a_blocked_chat_and_retries_a_failed_send_itself(bot, sandbox) -> None:
    sandbox.fault("403", chat_id=402)  # the user blocked the bot
    sandbox.fault("5xx", status=502, chat_id=403, count=1)
    ids = broadcast(bot, [401, 402, 403, 404])

    first = batch.outbound_broadcasts_drain(bot.pk)

    assert (first.sent, first.failed) == (2, 2)
    letter = DeadLetter.objects.get(message__chat_id=402)
    assert letter.reason_class == ErrorClass.PERMANENT
    # The 502's retry is the broadcast drain's (its continuations, then a timer for when it
    # falls due), all on the bulk queue: nothing for it on the queue of routers and replies.
    assert drain_until_done().sent == 1
    assert queued() == []
    assert states(ids) == {State.SENT: 3, State.FAILED: 1}
    delivered = [c["chat_id"] for c in sandbox.calls(token=bot.token, method="sendMessage") if c["delivered"]]
    assert sorted(delivered) == [401, 403, 404]


@pytest.mark.django_db(transaction=True)
@override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0)
def test_the_sweeper_wakes_a_lost_broadcast_drain_and_puts_no_broadcast_message_on_the_interactive_queue(
    bot, sandbox
) -> None:
    ids = broadcast(bot, list(range(501, 601)))
    wakeups.release(batch.bulk_drain_key(bot.pk))  # the drain and its broker message were lost
    for queue in (settings.CELERY_TASK_QUEUE_BULK, settings.CELERY_TASK_QUEUE_BULK):
        from outbox import ratelimit

        ratelimit.redis_client().delete(f"{settings.DOVECOTE_REDIS_PREFIX}{queue}")

    report = sweep()

    assert report["broadcast_drains_woken"] == 1
    assert report["messages_redispatched"] == 0
    assert queued() == []
    assert bulk_queue() == [("outbox.drain_broadcasts", [bot.pk])]
    # A second sweep while that drain is queued publishes nothing more.
    sweep()
    assert bulk_queue() == [("outbox.drain_broadcasts", [bot.pk])]
    assert states(ids) == {State.PENDING: 100}


@pytest.mark.django_db(transaction=True)
def test_a_broadcast_drain_waits_its_turn_when_its_host_runs_as_many_as_it_may(bot, sandbox, settings) -> None:
    settings.DOVECOTE_BULK_DRAINS_PER_HOST = 1
    broadcast(bot, [701, 702])
    assert wakeups.take_permit(batch.bulk_permits_key(), "another-drain", limit=1)

    report = batch.outbound_broadcasts_drain(bot.pk)

    assert (report.sent, report.continuation) == (0, batch.BULK_PERMIT_RETRY_SECONDS)
    assert sandbox.calls(token=bot.token, method="sendMessage") == []
    wakeups.return_permit(batch.bulk_permits_key(), "another-drain")
    assert drain_until_done().sent == 2


@pytest.mark.e2e
def test_a_broadcast_drain_killed_after_claiming_its_batch_is_recovered_and_each_chat_gets_one_message(
    process_env, processes, sandbox, bot_factory
) -> None:
    from tests.e2e.test_crash import LEASE, crash_worker, lease_expired

    bot = bot_factory()
    doomed = crash_worker(process_env, processes, failpoint="after_claim", name="bulk-doomed")
    ids = broadcast(bot, list(range(801, 807)))
    wait_until(lambda: not doomed.alive(), timeout=30, message="the worker killed itself after claiming the batch")
    rows = OutboundMessage.objects.filter(pk__in=ids)
    assert {(m.state, m.attempts) for m in rows} == {(State.SENDING, 0)}

    crash_worker(process_env, processes, name="bulk-survivor")
    wait_until(lambda: all(lease_expired(m) for m in rows.all()), timeout=LEASE + 5)
    with override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0):
        assert sweep()["messages_released"] == 6

        def all_sent() -> bool:
            sweep()  # as beat would, once the dead drain's wake-up key has expired
            return rows.filter(state=State.SENT).count() == 6

        wait_until(all_sent, timeout=30, interval=1.0)

    assert {m.attempts for m in rows.all()} == {1}
    assert sorted(c["chat_id"] for c in sandbox.calls(token=bot.token, method="sendMessage")) == list(range(801, 807))
