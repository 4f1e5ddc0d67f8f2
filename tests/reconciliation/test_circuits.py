"""Circuit breakers: one alert per outage, one half-open probe at a time, closed on a
successful probe (a getMe task published for the probe's time), then the backlog released
to the bot's drain at once."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings
from django.utils import timezone

from core import wakeups
from outbox import circuits
from outbox.models import Circuit, CircuitState, OutboundMessage, State
from outbox.sending import probe
from outbox.sending.single import outbound_message_send
from outbox.services import outbound_message_enqueue
from reconciliation.sweeper import sweep
from tests.reconciliation.factories import message_row
from tests.support import METRICS_AUTH, queued

NO_GRACE = {"DOVECOTE_REDISPATCH_GRACE_SECONDS": 0, "DOVECOTE_SWEEP_INTERVAL_SECONDS": 15}


def alerts(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "alert", None) == "circuit_open"]


def probe_due(scope: str) -> None:
    Circuit.objects.filter(scope=scope).update(next_probe_at=timezone.now() - timedelta(seconds=1))


def test_a_revoked_token_opens_the_circuit_once_and_keeps_the_queue(bot, sandbox, caplog) -> None:
    sandbox.fault("401")
    messages = [
        outbound_message_enqueue(bot_id=bot.pk, chat_id=100 + i, payload={"text": "hi"}, idempotency_key=f"a{i}")[0]
        for i in range(3)
    ]
    statuses = [outbound_message_send(m.pk).status for m in messages]

    assert statuses == ["circuit-opened", "circuit-open", "circuit-open"]
    assert len(sandbox.calls(token=bot.token)) == 1
    assert len(alerts(caplog)) == 1
    assert Circuit.objects.get(scope=f"bot:{bot.pk}").state == CircuitState.OPEN
    assert set(OutboundMessage.objects.filter(bot=bot).values_list("state", flat=True)) <= {State.PENDING, State.RETRY}


def test_the_metrics_show_an_open_circuit(bot, client) -> None:
    circuits.open_for_auth(f"bot:{bot.pk}", reason="Unauthorized")
    body = client.get("/metrics", headers=METRICS_AUTH).content.decode()
    assert f'dovecote_circuit_open{{scope="bot {bot.name}",state="open"}} 1' in body


@pytest.mark.django_db(transaction=True)
def test_only_one_caller_wins_the_half_open_probe() -> None:
    circuits.open_for_auth("consumer:crm", reason="401")
    probe_due("consumer:crm")
    wins: list[bool] = []
    start = threading.Barrier(4)

    def contender() -> None:
        try:
            start.wait()
            wins.append(circuits.allow("consumer:crm"))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=contender) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(wins) == [False, False, False, True]
    assert Circuit.objects.get(scope="consumer:crm").state == CircuitState.HALF_OPEN


def test_a_successful_probe_closes_the_circuit(bot, sandbox) -> None:
    scope = f"bot:{bot.pk}"
    circuits.open_for_auth(scope, reason="Unauthorized")
    message, _ = outbound_message_enqueue(bot_id=bot.pk, chat_id=7, payload={"text": "probe"}, idempotency_key="p")
    assert outbound_message_send(message.pk).status == "circuit-open"  # not yet: the probe is not due
    probe_due(scope)

    assert outbound_message_send(message.pk).status == "sent"
    assert Circuit.objects.get(scope=scope).state == CircuitState.CLOSED
    assert len(sandbox.messages(token=bot.token)) == 1


def test_a_probe_that_telegram_refuses_for_its_own_reasons_still_closes_the_circuit(bot, sandbox) -> None:
    # The token works again; the probe's chat, though, has blocked the bot: Telegram answered,
    # so the bot is reachable and authorised, and its queue need not wait for another probe.
    scope = f"bot:{bot.pk}"
    circuits.open_for_auth(scope, reason="Unauthorized")
    probe, _ = outbound_message_enqueue(bot_id=bot.pk, chat_id=8, payload={"text": "probe"}, idempotency_key="p1")
    waiting, _ = outbound_message_enqueue(bot_id=bot.pk, chat_id=9, payload={"text": "next"}, idempotency_key="p2")
    sandbox.fault("403", chat_id=8)
    probe_due(scope)

    assert outbound_message_send(probe.pk).status == "dead-lettered"
    assert Circuit.objects.get(scope=scope).state == CircuitState.CLOSED
    assert outbound_message_send(waiting.pk).status == "sent"


def test_a_failed_probe_reopens_for_longer_without_a_second_alert(db: None, caplog) -> None:
    circuits.open_for_auth("consumer:crm", reason="401")
    Circuit.objects.filter(scope="consumer:crm").update(
        opened_at=timezone.now() - timedelta(seconds=30), next_probe_at=timezone.now()
    )
    assert circuits.allow("consumer:crm")
    delay = circuits.open_for_auth("consumer:crm", reason="401 again")
    circuit = Circuit.objects.get(scope="consumer:crm")
    assert circuit.state == CircuitState.OPEN
    assert delay >= 2 * settings.DOVECOTE_CIRCUIT_FIRST_PROBE_SECONDS
    assert len(alerts(caplog)) == 1


def test_a_probe_whose_worker_died_is_taken_again_after_its_lease(db: None) -> None:
    circuits.open_for_auth("consumer:crm", reason="401")
    probe_due("consumer:crm")
    assert circuits.allow("consumer:crm")
    assert not circuits.allow("consumer:crm")
    probe_due("consumer:crm")  # the probe's lease ran out: its worker died
    assert circuits.allow("consumer:crm")


def test_an_operator_pause_has_no_probe(db: None) -> None:
    circuits.pause("consumer:crm", reason="CRM maintenance")
    Circuit.objects.filter(scope="consumer:crm").update(next_probe_at=timezone.now() - timedelta(hours=1))
    assert not circuits.allow("consumer:crm")
    circuits.resume("consumer:crm")
    assert circuits.allow("consumer:crm")


@pytest.mark.django_db(transaction=True)
def test_an_open_bot_is_probed_by_a_task_of_its_own_and_its_backlog_released_when_it_closes(bot, sandbox) -> None:
    scope = f"bot:{bot.pk}"
    past = timezone.now() - timedelta(minutes=5)
    later = timezone.now() + timedelta(minutes=5)
    for i in range(20):
        message_row(bot, key=f"backlog-{i}", chat_id=1000 + i, next_attempt_at=past)
    # Retries the outage scheduled far ahead (backoff), one a 429's, one not before its send_at.
    outage = [
        message_row(bot, key=f"outage-{i}", chat_id=2000 + i, state=State.RETRY, attempts=3, next_attempt_at=later)
        for i in range(3)
    ]
    OutboundMessage.objects.filter(pk__in=[m.pk for m in outage]).update(last_error_class="transient")
    flood = message_row(bot, key="flood", chat_id=3000, state=State.RETRY, attempts=1, next_attempt_at=later)
    OutboundMessage.objects.filter(pk=flood.pk).update(last_error_class="rate_limited")
    scheduled = message_row(bot, key="scheduled", chat_id=3001, state=State.RETRY, attempts=1, next_attempt_at=later)
    OutboundMessage.objects.filter(pk=scheduled.pk).update(last_error_class="transient", send_at=later)
    sandbox.fault("401")
    with override_settings(**NO_GRACE):
        delay = circuits.open_for_auth(scope, reason="Unauthorized")
        assert delay == settings.DOVECOTE_CIRCUIT_FIRST_PROBE_SECONDS
        # Opening it published the probe for its time (one, however many failures follow).
        circuits.record_failure(scope, reason="502")
        assert [t.name for t in queued()] == ["outbox.probe_bot"]
        clear_queue()
        assert sweep()["messages_redispatched"] == 0  # open: nothing is sent but the probe

        assert probe.bot_circuit_probe(bot.pk) == "not-due"
        assert [t.name for t in queued()] == ["outbox.probe_bot"]  # it comes back when due
        clear_queue()
        probe_due(scope)
        assert probe.bot_circuit_probe(bot.pk) == "probe-failed"  # the token is still refused
        circuit = Circuit.objects.get(scope=scope)
        assert circuit.state == CircuitState.OPEN
        assert [t.name for t in queued()] == ["outbox.probe_bot"]  # the next one, scheduled
        clear_queue()

        probe_due(scope)
        wakeups.release(probe.probe_key(bot.pk))  # the probe task was lost, its key expired
        assert sweep()["messages_probes"] == 1  # the sweeper wakes one
        assert [t.name for t in queued()] == ["outbox.probe_bot"]
        clear_queue()

        sandbox.clear_faults()
        probe_due(scope)
        assert probe.bot_circuit_probe(bot.pk) == "closed-by-probe"

    assert Circuit.objects.get(scope=scope).state == CircuitState.CLOSED
    assert [c["method"] for c in sandbox.calls(token=bot.token)] == ["getMe", "getMe"]
    # The backlog goes to the bot's drain at once, the outage's retries due now.
    assert [t.name for t in queued()] == ["outbox.drain_bot"]
    now = timezone.now()
    assert all(m.next_attempt_at <= now for m in OutboundMessage.objects.filter(pk__in=[m.pk for m in outage]))
    assert OutboundMessage.objects.get(pk=flood.pk).next_attempt_at > now
    assert OutboundMessage.objects.get(pk=scheduled.pk).next_attempt_at > now


def clear_queue() -> None:
    import redis

    redis.Redis.from_url(settings.REDIS_URL).delete(
        f"{settings.DOVECOTE_REDIS_PREFIX}{settings.CELERY_TASK_DEFAULT_QUEUE}"
    )


def _run_queued_sends() -> None:
    """Play the worker in-process: run the send and drain tasks the sweeper published, once."""
    import redis
    from django.conf import settings

    from outbox.sending.batch import outbound_messages_drain
    from tests.support import queued

    tasks = queued()
    redis.Redis.from_url(settings.REDIS_URL).delete(
        f"{settings.DOVECOTE_REDIS_PREFIX}{settings.CELERY_TASK_DEFAULT_QUEUE}"
    )
    for task in tasks:
        if task.name == "outbox.send_outbound_message":
            outbound_message_send(task.args[0])
        elif task.name == "outbox.drain_bot":
            outbound_messages_drain(task.args[0])
        elif task.name == "outbox.probe_bot":
            probe.bot_circuit_probe(task.args[0])


@override_settings(**NO_GRACE, DOVECOTE_RATE_LIMITS_ENABLED=False)
def test_a_bot_whose_chats_hold_two_messages_each_recovers_after_an_outage(bot, sandbox) -> None:
    """Found from outside: 502s for 8 s while 10 chats held two replies each; jittered backoff
    made each chat's second message due before its head, the probe picked a second message,
    which may not overtake its head, and the bot never came back."""
    now = timezone.now()
    for chat in range(10):
        for n, due_ago in ((1, 1), (2, 5)):  # the second falls due before the head
            message_row(
                bot,
                key=f"outage-{chat}-{n}",
                state=State.RETRY,
                chat_id=7000 + chat,
                payload={"text": f"chat {chat} reply {n}"},
                attempts=3,
                next_attempt_at=now - timedelta(seconds=due_ago),
            )
    scope = f"bot:{bot.pk}"
    circuits.record_failure(scope, reason="502")
    Circuit.objects.filter(scope=scope).update(consecutive_failures=circuits.FAILURES_TO_OPEN)
    circuits.record_failure(scope, reason="502")
    assert Circuit.objects.get(scope=scope).state == CircuitState.OPEN
    probe_due(scope)

    for _ in range(10):
        sweep()
        _run_queued_sends()
        if OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 20:
            break

    assert Circuit.objects.get(scope=scope).state == CircuitState.CLOSED
    assert OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 20
    for chat in range(10):
        assert sandbox.sent_texts(token=bot.token, chat_id=7000 + chat) == [f"chat {chat} reply {n}" for n in (1, 2)]


@pytest.mark.django_db(transaction=True)
def test_a_success_after_failures_too_few_to_open_the_circuit_releases_their_retries(bot) -> None:
    scope = f"bot:{bot.pk}"
    later = timezone.now() + timedelta(minutes=2)
    waiting = message_row(bot, key="backed-off", chat_id=4000, state=State.RETRY, attempts=4, next_attempt_at=later)
    OutboundMessage.objects.filter(pk=waiting.pk).update(last_error_class="transient")
    circuits.record_failure(scope, reason="502")
    assert Circuit.objects.get(scope=scope).state == CircuitState.CLOSED

    circuits.record_success(scope)  # the Bot API answers again

    assert Circuit.objects.get(scope=scope).consecutive_failures == 0
    assert OutboundMessage.objects.get(pk=waiting.pk).next_attempt_at <= timezone.now()
    assert [t.name for t in queued()] == ["outbox.drain_bot"]


@pytest.mark.django_db(transaction=True)
def test_a_probe_task_that_finds_a_probe_out_does_not_hold_back_the_next_one(bot) -> None:
    """Found by the fault schedules at production's defaults: a second probe task, finding
    the circuit half-open, set a timer for the probe's lease (60 s) on the probe key, and
    the failed probe's next one (4 s) was then never published."""
    scope = f"bot:{bot.pk}"
    circuits.open_for_auth(scope, reason="Unauthorized")
    probe_due(scope)
    assert circuits.try_probe(scope)  # a probe is out
    clear_queue()
    wakeups.release(probe.probe_key(bot.pk))

    assert probe.bot_circuit_probe(bot.pk) == "probing-elsewhere"
    assert queued() == []
    circuits.record_failure(scope, reason="502")  # the probe out failed

    assert [t.name for t in queued()] == ["outbox.probe_bot"]


def test_a_bots_probe_holds_its_circuit_for_its_calls_timeouts_not_a_consumers_lease(db: None) -> None:
    """Found by the fault schedules: a probe lost with its worker held the bot's circuit
    half-open for the 60 s lease, and its replies with it."""
    circuits.open_for_auth("bot:7", reason="Unauthorized")
    circuits.open_for_auth("consumer:crm", reason="401")
    probe_due("bot:7")
    probe_due("consumer:crm")
    assert circuits.try_probe("bot:7")
    assert circuits.try_probe("consumer:crm")

    held = {c.scope: (c.next_probe_at - timezone.now()).total_seconds() for c in Circuit.objects.all()}
    call = settings.DOVECOTE_TELEGRAM_CONNECT_TIMEOUT + settings.DOVECOTE_TELEGRAM_READ_TIMEOUT
    assert held["bot:7"] <= call + circuits.BOT_PROBE_MARGIN_SECONDS
    assert held["consumer:crm"] > settings.DOVECOTE_CIRCUIT_PROBE_LEASE_SECONDS - 5
