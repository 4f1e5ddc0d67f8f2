"""Seed 004's four restart points, one worker death each, with real processes: a Celery
worker (``-P solo``, so its SIGKILL takes the whole worker down) kills itself at a named
failpoint (DOVECOTE_FAILPOINTS, core/failpoints.py); a fresh worker and the sweeper
(in-process, as beat would run it) then recover. For each point the seed asks to measure:
the messages in the channel (the sandbox), the local state, the attempts, and that the
idempotency key never changed.

How the points map onto a send (an enqueued message goes out through its bot's drain):

1. before the job is committed  -> `before_claim_commit`: the claim's UPDATE ran, its
   COMMIT did not; PostgreSQL rolls it back with the dead worker's connection.
2. after the commit, before sending -> `after_claim` (claimed, no attempt row) and
   `before_request` (the attempt row is committed, the request never went).
3. after sending, before the acknowledgement -> `after_response`: requests went out, the
   first answer is in the worker's memory and none is recorded.
4. after the acknowledgement, before the local mark -> `after_record`. Here recording
   Telegram's answer *is* the local mark (one statement marks the attempt ok and the
   message sent), so there is no moment between them to die in; the closest death is
   right after that commit, and nothing may be sent again because of it.

A drain sends a batch at rate-limit slots ~33 ms apart, so when it dies not every request
of its batch has started: the batch test asserts per message, by its attempts.
"""

from __future__ import annotations

import time

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from outbox.models import OutboundMessage, State
from outbox.sending.single import outbound_message_send
from outbox.services import outbound_message_enqueue
from reconciliation import services as reconciliation_services
from reconciliation.models import CaseStatus, ReconciliationCase
from reconciliation.sweeper import sweep
from tests.support import Process, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

# The workers here are killed, never left waiting for an answer: dovecote.E001 (a send lease
# longer than a send may take) is silenced for them (project/test_settings.py).
SHORT_SEND_LEASE_ALLOWED = {"DOVECOTE_TEST_SILENCED_CHECKS": "dovecote.E001"}
LEASE = 2  # seconds: DOVECOTE_SEND_LEASE_SECONDS for the workers, so a dead one is noticed fast
TEXT = "Your order #1 is confirmed"


def worker_with(
    process_env: dict[str, str], processes: list[Process], *, failpoint: str = "", name: str = "worker"
) -> Process:
    env = {**process_env, "DOVECOTE_SEND_LEASE_SECONDS": str(LEASE), **SHORT_SEND_LEASE_ALLOWED}
    if failpoint:
        env["DOVECOTE_FAILPOINTS"] = failpoint
    proc = start_worker(env, pool="solo", concurrency=1, name=name)
    processes.append(proc)
    return proc


def enqueue(bot, key: str, *, chat_id: int = 4242, text: str = TEXT) -> OutboundMessage:
    message, created = outbound_message_enqueue(
        bot_id=bot.pk, chat_id=chat_id, payload={"text": text}, idempotency_key=key
    )
    assert created
    return message


def enqueue_batch(bot, prefix: str, n: int = 4) -> list[OutboundMessage]:
    # One commit, so that one drain claims them all in one batch.
    with transaction.atomic():
        return [enqueue(bot, f"{prefix}-{i}", chat_id=5000 + i, text=f"{prefix} {i}") for i in range(n)]


def died(proc: Process, what: str) -> None:
    wait_until(lambda: not proc.alive(), timeout=20, message=f"the worker to kill itself {what}")


def leases_expired(*messages: OutboundMessage) -> bool:
    rows = OutboundMessage.objects.filter(pk__in=[m.pk for m in messages])
    return all(m.lease_expires_at is None or m.lease_expires_at < timezone.now() for m in rows)


def sweep_once() -> dict[str, int]:
    with override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0):
        return sweep()


def sweep_until(predicate, *, timeout: float = 30) -> dict[str, int]:
    """Run the sweeper as beat would (every second here, no redispatch grace) until the
    predicate holds; returns what the sweeps did in total. A drain that died keeps its
    bot's wake-up key for up to 5 s, so the first sweeps may find nothing to wake."""
    total: dict[str, int] = {}

    def swept() -> bool:
        for name, n in sweep_once().items():
            total[name] = total.get(name, 0) + n
        return predicate()

    wait_until(swept, timeout=timeout, interval=1.0)
    return total


def sent(*messages: OutboundMessage):
    return lambda: OutboundMessage.objects.filter(pk__in=[m.pk for m in messages], state=State.SENT).count() == len(
        messages
    )


def state_of(message: OutboundMessage) -> tuple[str, int, str]:
    message.refresh_from_db()
    return message.state, message.attempts, message.idempotency_key


def outcomes(message: OutboundMessage) -> list[str]:
    return list(message.attempt_set.order_by("number").values_list("outcome", flat=True))


def assert_held_unknown(message: OutboundMessage, key: str) -> ReconciliationCase:
    """Unknown with an open case under the same key, and not resent by anyone."""
    assert state_of(message) == (State.UNKNOWN, 1, key)
    case = ReconciliationCase.objects.get(message=message)
    assert (case.status, case.idempotency_key) == (CaseStatus.OPEN, key)
    assert outbound_message_send(message.pk).status == "not-waiting"
    return case


# --- 1. before the job is committed ------------------------------------------------------


def test_restart_point_1_before_the_job_is_committed_the_claim_rolls_back_and_a_new_worker_sends_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = worker_with(process_env, processes, failpoint="before_claim_commit", name="worker-p1")
    message = enqueue(bot, "point-1")
    died(doomed, "inside its claim's transaction")

    # The claim died uncommitted: the row is as the producer left it, nothing was sent.
    message.refresh_from_db()
    assert (message.state, message.attempts, message.lease_owner) == (State.PENDING, 0, "")
    assert not message.attempt_set.exists()
    assert sandbox.calls(token=bot.token) == []

    worker_with(process_env, processes, name="worker-p1b")
    sweep_until(sent(message))

    assert state_of(message) == (State.SENT, 1, "point-1")
    assert outcomes(message) == ["ok"]
    assert sandbox.sent_texts(token=bot.token) == [TEXT]


# --- 2. after the commit, before sending -------------------------------------------------


def test_restart_point_2_after_commit_before_sending_a_claimed_message_is_released_and_sent_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = worker_with(process_env, processes, failpoint="after_claim", name="worker-p2")
    message = enqueue(bot, "point-2")
    died(doomed, "after its claim committed")

    message.refresh_from_db()
    assert (message.state, message.attempts) == (State.SENDING, 0)
    assert sandbox.calls(token=bot.token) == []

    worker_with(process_env, processes, name="worker-p2b")
    wait_until(lambda: leases_expired(message), timeout=LEASE + 5)
    report = sweep_until(sent(message))

    assert report["messages_released"] == 1
    assert state_of(message) == (State.SENT, 1, "point-2")
    assert outcomes(message) == ["ok"]
    assert sandbox.sent_texts(token=bot.token) == [TEXT]


def test_restart_point_2_after_the_attempt_is_recorded_before_the_request_nothing_is_in_the_chat_and_it_is_held(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = worker_with(process_env, processes, failpoint="before_request", name="worker-p2c")
    message = enqueue(bot, "point-2-attempt")
    died(doomed, "after writing the attempt row, before the request")

    message.refresh_from_db()
    assert (message.state, message.attempts) == (State.SENDING, 1)
    assert message.attempt_set.get().finished_at is None
    wait_until(lambda: leases_expired(message), timeout=LEASE + 5)
    worker_with(process_env, processes, name="worker-p2d")
    assert sweep()["messages_unknown"] == 1

    # The attempt row says a request may have started: zero messages in the chat, yet the
    # outbox cannot know that, so the message is held for a decision, never resent alone.
    case = assert_held_unknown(message, "point-2-attempt")
    sweep_once()
    time.sleep(1.0)
    assert sandbox.calls(token=bot.token, method="sendMessage") == []

    # An operator finds nothing in the chat and resends: the same key, one message.
    operator = get_user_model().objects.create_user("alice", is_staff=True)
    reconciliation_services.case_resend(case, operator, "not in the chat history")
    wait_until(sent(message), timeout=20)
    assert state_of(message) == (State.SENT, 2, "point-2-attempt")
    assert outcomes(message) == ["ambiguous", "ok"]
    assert sandbox.sent_texts(token=bot.token) == [TEXT]


# --- 3. after sending, before the acknowledgement ----------------------------------------


def test_restart_point_3_after_sending_before_the_acknowledgement_each_message_is_held_or_sent_once(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = worker_with(process_env, processes, failpoint="after_response", name="worker-p3")
    messages = enqueue_batch(bot, "point-3")
    died(doomed, "with the first answer in and none recorded")

    rows = OutboundMessage.objects.filter(pk__in=[m.pk for m in messages])
    assert {m.state for m in rows} == {State.SENDING}
    assert not rows.filter(attempt_set__outcome="ok").exists()  # no answer was recorded
    begun = [m for m in rows if m.attempts == 1]
    not_begun = [m for m in rows if m.attempts == 0]
    assert begun, "at least the request whose answer came back had started"
    assert len(sandbox.calls(token=bot.token, method="sendMessage")) >= 1

    worker_with(process_env, processes, name="worker-p3b")
    wait_until(lambda: leases_expired(*messages), timeout=LEASE + 5)
    report = sweep_until(sent(*not_begun))
    assert (report["messages_unknown"], report["messages_released"]) == (len(begun), len(not_begun))

    for message in begun:
        # Its request went (or may have gone): at most one message in its chat, held.
        assert_held_unknown(message, message.idempotency_key)
        assert len(sandbox.messages(token=bot.token, chat_id=message.chat_id)) <= 1
    for message in not_begun:
        assert state_of(message) == (State.SENT, 1, message.idempotency_key)
        assert len(sandbox.messages(token=bot.token, chat_id=message.chat_id)) == 1
    answered = {m.pk: len(sandbox.calls(token=bot.token, chat_id=m.chat_id)) for m in messages}
    sweep_once()
    time.sleep(1.0)
    assert {m.pk: len(sandbox.calls(token=bot.token, chat_id=m.chat_id)) for m in messages} == answered
    assert {m.idempotency_key for m in rows.all()} == {f"point-3-{i}" for i in range(4)}


# --- 4. after the acknowledgement, before the local mark ---------------------------------


def test_restart_point_4_after_the_acknowledgement_the_local_mark_is_already_committed_and_nothing_is_resent(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory()
    doomed = worker_with(process_env, processes, failpoint="after_record", name="worker-p4")
    message = enqueue(bot, "point-4")
    died(doomed, "right after recording Telegram's answer")

    # Telegram's answer and the local mark are one commit: both there, or neither.
    delivered = sandbox.messages(token=bot.token)
    assert len(delivered) == 1
    message.refresh_from_db()
    assert (message.state, message.attempts, message.telegram_message_id) == (
        State.SENT,
        1,
        delivered[0]["message_id"],
    )

    # The dead drain held its bot's wake-up; a fresh worker and the sweeper carry on with
    # what came next, and the message already sent is never sent again.
    worker_with(process_env, processes, name="worker-p4b")
    later = enqueue(bot, "point-4-next", chat_id=4343, text="Your order #2 is confirmed")
    sweep_until(sent(later))

    assert state_of(message) == (State.SENT, 1, "point-4")
    assert outcomes(message) == ["ok"]
    assert state_of(later) == (State.SENT, 1, "point-4-next")
    assert sandbox.sent_texts(token=bot.token, chat_id=4242) == [TEXT]
    assert sandbox.sent_texts(token=bot.token, chat_id=4343) == ["Your order #2 is confirmed"]
