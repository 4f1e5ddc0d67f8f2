"""Each error class, against the Bot API sandbox over HTTP, with real PostgreSQL and Redis."""

from __future__ import annotations

import itertools

import pytest
from telegram import error as tg_error

from outbox import botapi
from outbox.models import Circuit, CircuitState, DeadLetter, ErrorClass, OutboundMessage, State
from outbox.sending import single
from reconciliation.models import ReconciliationCase
from tests.outbox.helpers import drive, enqueue

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast_backoff(settings) -> None:
    settings.DOVECOTE_RETRY_BASE_SECONDS = 0.05
    settings.DOVECOTE_RETRY_MAX_SECONDS = 0.2


def test_a_429_is_honoured_to_the_second_and_pauses_the_whole_bot(bot, sandbox) -> None:
    sandbox.fault("429", retry_after=2, count=1, token=bot.token)
    alice = enqueue(bot, chat_id=1001, text="to alice")
    bob = enqueue(bot, chat_id=1002, text="to bob")

    first = single.outbound_message_send(alice.pk)
    assert first.status == "retry"
    assert first.countdown == pytest.approx(2.0)
    # Bob's message is another chat, but flood control is per bot: it waits too, with no request.
    held = single.outbound_message_send(bob.pk)
    assert held.status == "rate-limited"
    assert 1.5 < held.countdown <= 2.0
    assert len(sandbox.calls(token=bot.token)) == 1

    _, alice = drive(alice.pk)
    _, bob = drive(bob.pk)

    assert (alice.state, bob.state) == (State.SENT, State.SENT)
    calls = sandbox.calls(token=bot.token)
    refused, later = calls[0], calls[1:]
    assert refused["status"] == 429
    assert len(later) == 2
    assert min(c["at"] for c in later) - refused["at"] >= 2.0
    attempts = list(alice.attempt_set.values_list("outcome", "http_status", "retry_after"))
    assert attempts == [(ErrorClass.RATE_LIMITED, 429, 2.0), ("ok", 200, None)]
    assert alice.rate_limited_count == 1
    assert bob.attempts == 1


def test_a_5xx_is_retried_with_backoff_and_then_sent(bot, sandbox) -> None:
    sandbox.fault("5xx", status=502, count=2, token=bot.token)
    message = enqueue(bot, text="eventually")

    _, message = drive(message.pk)

    assert message.state == State.SENT
    assert list(message.attempt_set.values_list("outcome", "http_status")) == [
        (ErrorClass.TRANSIENT, 502),
        (ErrorClass.TRANSIENT, 502),
        ("ok", 200),
    ]
    ats = [c["at"] for c in sandbox.calls(token=bot.token)]
    assert all(b - a >= 0.005 for a, b in itertools.pairwise(ats))
    assert sandbox.sent_texts(token=bot.token) == ["eventually"]
    assert not DeadLetter.objects.exists()


def test_a_message_that_exhausts_its_budget_is_failed_with_a_dead_letter(bot, sandbox) -> None:
    sandbox.fault("5xx", status=503, token=bot.token)
    message = enqueue(bot, text="never", max_attempts=3)

    result, message = drive(message.pk)

    assert result.status == "dead-lettered"
    assert message.state == State.FAILED
    assert message.attempts == 3
    assert len(sandbox.calls(token=bot.token)) == 3
    letter = DeadLetter.objects.get(message=message)
    assert letter.reason_class == ErrorClass.EXHAUSTED
    assert "Service Unavailable" in letter.first_error


def test_a_refused_connection_is_transient_because_nothing_was_sent(bot_factory) -> None:
    bot = bot_factory(api_base_url="http://127.0.0.1:9")
    message = enqueue(bot)

    result = single.outbound_message_send(message.pk)

    message.refresh_from_db()
    assert result.status == "retry"
    assert (message.state, message.last_error_class) == (State.RETRY, ErrorClass.TRANSIENT)


@pytest.mark.parametrize(("fault", "status"), [("400", 400), ("403", 403)])
def test_a_permanent_error_is_dead_lettered_at_once(bot, sandbox, fault, status) -> None:
    sandbox.fault(fault, token=bot.token)
    message = enqueue(bot)

    result, message = drive(message.pk)

    assert result.status == "dead-lettered"
    assert (message.state, message.attempts) == (State.FAILED, 1)
    assert message.attempt_set.get().http_status == status
    assert DeadLetter.objects.get(message=message).reason_class == ErrorClass.PERMANENT
    assert len(sandbox.calls(token=bot.token)) == 1


@pytest.mark.parametrize(
    "description",
    [
        "Bad Request: message is too long",
        "Bad Request: message caption is too long",
        'Bad Request: can\'t parse entities: Unsupported start tag "blink"',
        "Bad Request: message is not modified",
        "Bad Request: chat not found",
    ],
)
def test_every_400_is_permanent_at_once_whatever_it_says(description) -> None:
    outcome = botapi.classify(tg_error.BadRequest(description))

    assert (outcome.error_class, outcome.http_status) == (ErrorClass.PERMANENT, 400)


def test_a_400_whose_body_is_not_json_is_permanent_too() -> None:
    # python-telegram-bot raises BadRequest from the parsing error (a proxy's HTML page).
    try:
        raise tg_error.BadRequest("Bad Request (400)") from tg_error.TelegramError("Invalid server response")
    except tg_error.BadRequest as exc:
        outcome = botapi.classify(exc)

    assert outcome.error_class == ErrorClass.PERMANENT


def test_a_401_opens_the_bots_circuit_and_keeps_its_queue(bot, sandbox) -> None:
    sandbox.fault("401", token=bot.token)
    messages = [enqueue(bot, chat_id=2000 + i) for i in range(3)]

    first = single.outbound_message_send(messages[0].pk)
    rest = [single.outbound_message_send(m.pk) for m in messages[1:]]

    assert first.status == "circuit-opened"
    assert [r.status for r in rest] == ["circuit-open", "circuit-open"]
    assert len(sandbox.calls(token=bot.token)) == 1
    circuit = Circuit.objects.get(scope=f"bot:{bot.pk}")
    assert circuit.state == CircuitState.OPEN
    assert circuit.reason.startswith("auth")
    states = sorted(OutboundMessage.objects.filter(bot=bot).values_list("state", flat=True))
    assert states == [State.PENDING, State.PENDING, State.RETRY]
    assert not DeadLetter.objects.exists()
    # Still no request while it is open.
    assert single.outbound_message_send(messages[1].pk).status == "circuit-open"
    assert len(sandbox.calls(token=bot.token)) == 1


def test_a_migrated_chat_is_followed_and_the_message_sent_once(bot, sandbox, settings) -> None:
    settings.DOVECOTE_RATE_LIMITS_ENABLED = False
    sandbox.fault("migrate", migrate_to_chat_id=-100123, chat_id=-555, token=bot.token)
    first = enqueue(bot, chat_id=-555, text="first")
    second = enqueue(bot, chat_id=-555, text="second")

    _, first = drive(first.pk)
    _, second = drive(second.pk)

    assert (first.state, first.chat_id) == (State.SENT, -100123)
    assert (second.state, second.chat_id) == (State.SENT, -100123)
    assert sandbox.sent_texts(token=bot.token, chat_id=-100123) == ["first", "second"]
    assert len(sandbox.calls(token=bot.token, chat_id=-555)) == 1
    assert list(first.attempt_set.values_list("outcome", flat=True)) == [ErrorClass.MIGRATED, "ok"]


def test_an_answer_lost_after_delivery_makes_the_message_unknown_and_never_resent(bot, sandbox) -> None:
    sandbox.fault("drop_after_deliver", count=1, token=bot.token)
    message = enqueue(bot, text="did it arrive?")

    result, message = drive(message.pk)

    assert result.status == "unknown"
    assert (message.state, message.last_error_class) == (State.UNKNOWN, ErrorClass.AMBIGUOUS)
    case = ReconciliationCase.objects.get(message=message)
    assert case.idempotency_key == message.idempotency_key
    assert single.outbound_message_send(message.pk).status == "not-waiting"
    assert len(sandbox.calls(token=bot.token)) == 1
    assert sandbox.sent_texts(token=bot.token) == ["did it arrive?"]


def test_a_slow_answer_past_the_read_timeout_is_unknown_not_resent(bot_factory, sandbox, settings) -> None:
    settings.DOVECOTE_TELEGRAM_READ_TIMEOUT = 0.3
    bot = bot_factory()  # a new token: its HTTP client is built with the short timeout
    sandbox.fault("slow", delay=1.0, count=1, token=bot.token)
    message = enqueue(bot)

    result, message = drive(message.pk)

    assert result.status == "unknown"
    assert message.state == State.UNKNOWN
    assert "ReadTimeout" in message.last_error
    assert ReconciliationCase.objects.filter(message=message).count() == 1
    assert len(sandbox.calls(token=bot.token)) == 1
