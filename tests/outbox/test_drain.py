"""The batched drain (outbox/sending/batch.py): a bot's due messages claimed, sent and recorded a
batch at a time, with every rule of the single send. In-process drains against the sandbox
over HTTP, and real worker processes for the races and the wake-ups."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.utils import timezone

from core import wakeups
from outbox import circuits, dispatch, services, transitions
from outbox.models import Attempt, Circuit, CircuitState, DeadLetter, ErrorClass, OutboundMessage, State
from outbox.sending import batch
from reconciliation.sweeper import sweep
from tests.outbox.helpers import enqueue
from tests.outbox.test_delivery_rules import warm_up
from tests.support import Process, queued, start_worker, wait_until


@pytest.fixture
def no_limits(settings) -> None:
    settings.DOVECOTE_RATE_LIMITS_ENABLED = False
    settings.DOVECOTE_DRAIN_BATCH_SIZE = 8


def queued_tasks() -> list[str]:
    """Task names waiting in this run's default queue, as the broker holds them."""
    return [task.name for task in queued()]


def texts_by_chat(sandbox, bot) -> dict[int, list[str]]:
    chats: dict[int, list[str]] = {}
    for call in sandbox.calls(token=bot.token, method="sendMessage"):
        chats.setdefault(int(call["params"]["chat_id"]), []).append(call["params"]["text"])
    return chats


@pytest.mark.parametrize(
    ("rate_limit", "limiter", "drain_batch", "size"),
    [
        (30, True, 8, 8),  # Telegram's default: the horizon's 7.5 slots
        (50, True, 8, 13),
        (1000, True, 8, 32),  # a paid broadcast bot: at most MAX_SEND_BATCH in flight
        (30, False, 8, 32),  # the limiter off: nothing to wait for
        (1000, True, 1, 1),  # 1: one message per task, as the setting says
        (30, True, 50, 50),  # an operator's bigger batch stands
    ],
)
def test_a_batch_of_sends_is_as_big_as_the_bots_rate_allows(
    settings, rate_limit: int, limiter: bool, drain_batch: int, size: int
) -> None:
    from bots.models import Bot

    settings.DOVECOTE_RATE_LIMITS_ENABLED = limiter
    settings.DOVECOTE_DRAIN_BATCH_SIZE = drain_batch
    assert batch.send_batch_size(Bot(rate_limit=rate_limit)) == size


@pytest.mark.parametrize(("rate_limit", "size"), [(30, 8), (100, 25), (1000, 64)])
def test_a_broadcasts_batch_is_as_big_as_the_bots_rate_allows_in_its_horizon(rate_limit: int, size: int) -> None:
    from bots.models import Bot

    assert batch.send_batch_size(Bot(rate_limit=rate_limit), bulk=True) == size


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_drain_sends_every_due_message_once_a_batch_at_a_time(bot, sandbox) -> None:
    messages = [enqueue(bot, chat_id=1000 + i, text=f"note {i}") for i in range(70)]

    report = batch.outbound_messages_drain(bot.pk)

    # With the limiter off a batch is policy.MAX_SEND_BATCH (32) messages: 32 + 32 + 6.
    assert (report.sent, report.failed, report.batches) == (70, 0, 3)
    assert len(sandbox.calls(token=bot.token, method="sendMessage")) == 70
    rows = OutboundMessage.objects.filter(pk__in=[m.pk for m in messages])
    assert {(m.state, m.attempts) for m in rows} == {(State.SENT, 1)}
    assert all(m.telegram_message_id and m.sent_at and not m.lease_owner for m in rows)
    assert {(a.number, a.outcome, a.http_status) for a in Attempt.objects.filter(message__in=rows)} == {(1, "ok", 200)}
    assert batch.outbound_messages_drain(bot.pk).sent == 0  # nothing is sent twice


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_claim_takes_no_more_than_its_batch(bot) -> None:
    for i in range(12):
        enqueue(bot, chat_id=2000 + i)
    lease = timedelta(seconds=60)

    first = transitions.claim_batch(bot_id=bot.pk, worker="w1", lease=lease, limit=5)
    second = transitions.claim_batch(bot_id=bot.pk, worker="w2", lease=lease, limit=5)

    assert (len(first), len(second)) == (5, 5)
    assert not {m.pk for m in first} & {m.pk for m in second}
    assert OutboundMessage.objects.filter(bot=bot, state=State.SENDING).count() == 10
    assert OutboundMessage.objects.filter(bot=bot, state=State.PENDING).count() == 2


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_drain_sends_one_message_per_chat_at_a_time_and_keeps_each_chats_order(bot, sandbox) -> None:
    for n in range(4):
        for chat in (31, 32, 33):
            enqueue(bot, chat_id=chat, text=f"{chat}-{n}")

    report = batch.outbound_messages_drain(bot.pk)

    assert report.sent == 12
    assert report.batches == 4  # each batch holds the three chats' next message
    assert texts_by_chat(sandbox, bot) == {chat: [f"{chat}-{n}" for n in range(4)] for chat in (31, 32, 33)}


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_failed_send_in_a_batch_is_decided_alone(bot, sandbox, settings) -> None:
    settings.DOVECOTE_RETRY_BASE_SECONDS = 30  # the retry stays scheduled while we look
    blocked = enqueue(bot, chat_id=41, text="to someone who blocked the bot")
    flaky = enqueue(bot, chat_id=42, text="meets a 502")
    fine = [enqueue(bot, chat_id=43 + i, text=f"fine {i}") for i in range(3)]
    sandbox.fault("403", chat_id=41)
    sandbox.fault("5xx", status=502, chat_id=42, count=1)

    report = batch.outbound_messages_drain(bot.pk)

    assert (report.sent, report.failed) == (3, 2)
    blocked.refresh_from_db()
    flaky.refresh_from_db()
    assert (blocked.state, blocked.last_error_class) == (State.FAILED, ErrorClass.PERMANENT)
    assert DeadLetter.objects.filter(message=blocked).count() == 1
    assert (flaky.state, flaky.attempts, flaky.last_error_class) == (State.RETRY, 1, ErrorClass.TRANSIENT)
    assert flaky.next_attempt_at > timezone.now()
    assert flaky.attempt_set.get().http_status == 502
    assert {m.state for m in OutboundMessage.objects.filter(pk__in=[m.pk for m in fine])} == {State.SENT}


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_drain_cancels_expired_and_vetoed_messages_instead_of_sending_them(bot, sandbox, settings) -> None:
    settings.DOVECOTE_RELEVANCE_CHECK = "tests.outbox.test_delivery_rules.veto_stale"
    expired = enqueue(bot, chat_id=51, text="flash sale", expires_at=timezone.now() + timedelta(seconds=1))
    OutboundMessage.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    stale = enqueue(bot, chat_id=52, text="Pay for order #7")
    after_expired = enqueue(bot, chat_id=51, text="next in the chat")

    report = batch.outbound_messages_drain(bot.pk)

    assert (report.sent, report.cancelled) == (1, 2)
    expired.refresh_from_db()
    stale.refresh_from_db()
    assert (expired.state, expired.last_error_class) == (State.CANCELLED, ErrorClass.EXPIRED)
    assert (stale.state, stale.cancel_reason) == (State.CANCELLED, "not relevant: the order was already paid")
    assert OutboundMessage.objects.get(pk=after_expired.pk).state == State.SENT
    assert sandbox.sent_texts(token=bot.token) == ["next in the chat"]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_a_drain_leaves_broadcasts_and_a_bot_with_an_open_circuit_alone(bot, sandbox) -> None:
    broadcast = services.broadcast_enqueue(
        bot_id=bot.pk, chat_ids=[61, 62], payload={"text": "news"}, broadcast_key="b1"
    )
    assert batch.outbound_messages_drain(bot.pk).batches == 0  # paced by their own slots, one task each
    assert OutboundMessage.objects.filter(pk__in=broadcast.message_ids, state=State.PENDING).count() == 2

    reply = enqueue(bot, chat_id=63, text="a reply")
    circuits.pause(circuits.bot_scope(bot.pk), reason="operator pause")
    assert batch.outbound_messages_drain(bot.pk).batches == 0
    reply.refresh_from_db()
    assert reply.state == State.PENDING
    assert sandbox.calls(token=bot.token) == []


@pytest.mark.django_db
def test_under_the_rate_limit_a_drain_paces_the_bot_and_then_hands_the_worker_back(bot_factory, sandbox) -> None:
    bot = bot_factory(rate_limit=5)
    warm_up(bot)
    messages = [enqueue(bot, chat_id=700 + i, text=f"n{i}") for i in range(16)]

    report = batch.outbound_messages_drain(bot.pk)

    # About two seconds of sends at the bot's pace (96 % of 5/s), then a continuation.
    assert 8 <= report.sent <= 12, report
    assert report.deferred == 0
    assert report.continuation is not None
    assert queued_tasks() == ["outbox.drain_bot"]  # no task per message
    calls = sorted(c["at"] for c in sandbox.calls(token=bot.token, method="sendMessage"))
    assert len(calls) == report.sent
    # Never more than the bot's 5 in any second of arrivals, however a busy host delays one
    # request against the next; on average one slot apart (1 / (0.96 * 5) = 0.208 s).
    assert max(sum(1 for t in calls if start <= t < start + 1.0) for start in calls) <= 5
    assert (calls[-1] - calls[0]) / (len(calls) - 1) > 0.18
    left = OutboundMessage.objects.filter(pk__in=[m.pk for m in messages], state=State.PENDING)
    assert left.count() == 16 - report.sent
    assert all(m.next_attempt_at <= timezone.now() for m in left)  # still due, for the continuation


@pytest.mark.django_db(transaction=True)
def test_a_burst_of_messages_wakes_one_drain_not_one_task_per_message(bot) -> None:
    for i in range(50):
        enqueue(bot, chat_id=800 + i)

    assert queued_tasks() == ["outbox.drain_bot"]
    assert queued()[0].args == [bot.pk]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("no_limits")
def test_the_woken_drain_holds_the_wake_up_until_nothing_is_left(bot, sandbox) -> None:
    queue = f"{settings.DOVECOTE_REDIS_PREFIX}{settings.CELERY_TASK_DEFAULT_QUEUE}"
    enqueue(bot, chat_id=1301)
    enqueue(bot, chat_id=1302)
    assert queued_tasks() == ["outbox.drain_bot"]
    redis.Redis.from_url(settings.REDIS_URL).delete(queue)  # a worker took the task

    assert batch.outbound_messages_drain(bot.pk).sent == 2  # ... and ran it
    enqueue(bot, chat_id=1303)

    # The drain let go of the wake-up when it found nothing more: the next message wakes one.
    assert queued_tasks() == ["outbox.drain_bot"]


@pytest.mark.django_db(transaction=True)
def test_with_the_drain_switched_off_each_message_gets_its_own_task(bot, settings) -> None:
    settings.DOVECOTE_DRAIN_BATCH_SIZE = 1
    for i in range(3):
        enqueue(bot, chat_id=900 + i)
    assert queued_tasks() == ["outbox.send_outbound_message"] * 3


@pytest.mark.e2e
def test_workers_draining_one_backlog_together_send_each_message_exactly_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    env = {**process_env, "DOVECOTE_RATE_LIMITS_ENABLED": "0", "DOVECOTE_DRAIN_BATCH_SIZE": "8"}
    now = timezone.now()
    OutboundMessage.objects.bulk_create(
        [
            OutboundMessage(
                bot=bot, chat_id=5000 + i % 40, payload={"text": f"m{i}"}, idempotency_key=f"b{i}", next_attempt_at=now
            )
            for i in range(240)
        ]
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {OutboundMessage._meta.db_table}")
    for name in ("drain-a", "drain-b"):
        processes.append(start_worker(env, concurrency=2, name=name))
    ids = list(OutboundMessage.objects.filter(bot=bot).order_by("pk").values_list("pk", flat=True))
    for pk in ids:
        dispatch.dispatch(pk, bot_id=bot.pk)  # as each enqueue does after its commit

    wait_until(lambda: OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 240, timeout=60)

    calls = sandbox.calls(token=bot.token, method="sendMessage")
    assert len(calls) == 240
    assert sorted(c["params"]["text"] for c in calls) == sorted(f"m{i}" for i in range(240))
    assert set(OutboundMessage.objects.filter(bot=bot).values_list("attempts", flat=True)) == {1}
    # Forty chats with six ordered messages each: every chat got them in order.
    for chat, texts in texts_by_chat(sandbox, bot).items():
        assert texts == [f"m{i}" for i in range(chat - 5000, 240, 40)]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_limits")
def test_after_an_outage_a_drain_sends_the_backlog_with_the_new_messages(bot, sandbox) -> None:
    backlog = [enqueue(bot, chat_id=1100 + i, text=f"old {i}") for i in range(5)]
    OutboundMessage.objects.filter(pk__in=[m.pk for m in backlog]).update(
        next_attempt_at=timezone.now() - timedelta(minutes=5)
    )
    # The bot's circuit was open for the outage and has just closed.
    Circuit.objects.create(
        scope=circuits.bot_scope(bot.pk),
        state=CircuitState.CLOSED,
        opened_at=timezone.now() - timedelta(minutes=5),
    )
    fresh = enqueue(bot, chat_id=1200, text="a new reply")

    report = batch.outbound_messages_drain(bot.pk)

    # No ramp over sweeper ticks: the drain paces the backlog at the bot's rate.
    assert report.sent == 6
    assert sorted(sandbox.sent_texts(token=bot.token)) == ["a new reply", *(f"old {i}" for i in range(5))]
    assert OutboundMessage.objects.get(pk=fresh.pk).state == State.SENT


@pytest.mark.django_db(transaction=True)
def test_the_sweeper_wakes_a_new_drain_once_a_lost_ones_wake_up_has_expired(bot, settings) -> None:
    settings.DOVECOTE_REDISPATCH_GRACE_SECONDS = 0
    for i in range(3):
        enqueue(bot, chat_id=1400 + i)
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(f"{settings.DOVECOTE_REDIS_PREFIX}{settings.CELERY_TASK_DEFAULT_QUEUE}")  # the drain task is lost
    key = f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:drain:{bot.pk}"
    assert 0 < client.pttl(key) <= wakeups.KEY_TTL_MS  # its wake-up key is not, for a few seconds

    # While the key stands, the sweep trusts it (a live drain would take the messages in turn) ...
    assert sweep()["messages_redispatched"] == 3
    assert queued_tasks() == []
    client.pexpire(key, 1)  # ... the lost drain renews it no more
    time.sleep(0.05)

    assert sweep()["messages_redispatched"] == 3
    assert queued_tasks() == ["outbox.drain_bot"]  # one drain for the bot, not a task per message


def test_a_drain_whose_rate_limiter_is_unreachable_sends_nothing_and_leaves_nothing_claimed(bot, sandbox) -> None:
    """Found by the fault schedules (Redis restarted mid-batch): the limiter's error escaped
    the drain, so claimed messages waited out their lease and answers already in were lost."""
    from outbox.sending.batch import outbound_messages_drain
    from tests.outbox.helpers import limiter_redis_at
    from tests.support import free_port

    messages = [enqueue(bot, chat_id=900 + i, text=f"limiter {i}") for i in range(3)]
    with limiter_redis_at(f"redis://127.0.0.1:{free_port()}/0"):  # nothing listens there
        report = outbound_messages_drain(bot.pk)

    rows = OutboundMessage.objects.filter(pk__in=[m.pk for m in messages])
    assert {(m.state, m.attempts, m.lease_owner) for m in rows} == {(State.PENDING, 0, "")}
    assert report.deferred == 3
    assert sandbox.calls(token=bot.token) == []
