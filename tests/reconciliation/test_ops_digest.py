"""The ops digest: new dead letters, cases and circuit changes reach the operators' chat as
an ordinary outbox message of the ops bot (seen in the sandbox), by e-mail and through a
developer's notifier, at most once per window per kind; the ops bot never reports on itself
and never holds up the bot it reports on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.core import mail
from django.utils import timezone

from outbox import circuits
from outbox.models import Circuit, CircuitState, DeadLetter, OutboundMessage, State
from reconciliation import digest, sweeper
from tests.outbox.helpers import drive, enqueue
from tests.reconciliation.triage_helpers import failed_row

OPS_CHAT = 777000
received: list[dict] = []


def collect(**kwargs) -> None:
    """A developer's channel, named in DOVECOTE_OPS_NOTIFIERS."""
    received.append(kwargs)


@pytest.fixture
def ops_bot(bot_factory, settings):
    ops = bot_factory(name="opsbot")
    settings.DOVECOTE_OPS_BOT = ops.name
    settings.DOVECOTE_OPS_CHAT_ID = str(OPS_CHAT)
    settings.DOVECOTE_OPS_DIGEST_MINUTES = 5
    return ops


def digests(ops) -> list[OutboundMessage]:
    return list(OutboundMessage.objects.filter(bot=ops, idempotency_key__startswith="ops-digest:").order_by("pk"))


def delivered_texts(sandbox, ops) -> list[str]:
    for message in digests(ops):
        drive(message.pk)
    return [call["params"]["text"] for call in sandbox.calls(token=ops.token, method="sendMessage")]


def test_a_dead_letter_reaches_the_ops_chat_once_per_window_and_the_next_one_goes_in_the_next_digest(
    bot, ops_bot, sandbox
) -> None:
    failed_row(bot, reason_class="permanent")
    now = timezone.now()
    assert [d.kind for d in digest.flush(now)] == ["dead_letters"]

    texts = delivered_texts(sandbox, ops_bot)
    assert len(texts) == 1
    assert "1 new dead letter" in texts[0]
    assert "permanent: 1" in texts[0]
    assert [c["params"]["chat_id"] for c in sandbox.calls(token=ops_bot.token)] == [OPS_CHAT]

    failed_row(bot, reason_class="transient")
    failed_row(bot, reason_class="transient")
    assert digest.flush(now + timedelta(seconds=30)) == []  # same window: no second message
    assert len(digests(ops_bot)) == 1

    later = now + timedelta(minutes=5)
    assert [d.counts for d in digest.flush(later)] == [{"transient": 2}]
    texts = delivered_texts(sandbox, ops_bot)
    assert len(texts) == 2
    assert "2 new dead letters" in texts[1]


def test_the_window_counts_from_the_previous_digest_not_from_the_clock(bot, ops_bot) -> None:
    # Clock-aligned windows let two digests go 30 s apart across a boundary (CI found it).
    window = 5 * 60
    at = datetime.fromtimestamp((int(timezone.now().timestamp()) // window + 2) * window - 10, UTC)

    def dead_letter(reason: str, *, at: datetime) -> None:
        DeadLetter.objects.filter(pk=failed_row(bot, reason_class=reason).pk).update(created_at=at)

    dead_letter("permanent", at=at - timedelta(seconds=1))
    assert len(digest.flush(at)) == 1
    dead_letter("transient", at=at + timedelta(seconds=20))
    assert digest.flush(at + timedelta(seconds=30)) == []  # the clock's window changed at +10 s
    assert digest.flush(at + timedelta(seconds=window - 1)) == []
    assert [d.counts for d in digest.flush(at + timedelta(seconds=window))] == [{"transient": 1}]
    assert len(digests(ops_bot)) == 2


def test_a_retried_digest_for_the_same_window_is_one_message(bot, ops_bot) -> None:
    failed_row(bot)
    now = timezone.now()
    digest.flush(now)
    # The window's claim lost (Redis flushed): the outbox key still makes it one message.
    from outbox import ratelimit

    ratelimit.redis_client().delete(digest.claim_key("dead_letters"))
    ratelimit.redis_client().delete(digest._key("dead_letters", "since"))
    digest.flush(now)
    assert len(digests(ops_bot)) == 1


def test_an_opened_and_a_closed_circuit_reach_the_ops_chat(bot, ops_bot, sandbox) -> None:
    scope = f"bot:{bot.pk}"
    circuits.open_for_auth(scope, reason="token refused")
    assert [d.counts for d in digest.flush(timezone.now())] == [{"opened": 1, f"opened {scope}": 1}]
    circuits.record_success(scope)
    assert digest.flush(timezone.now() + timedelta(minutes=5))[0].counts == {"closed": 1, f"closed {scope}": 1}
    texts = delivered_texts(sandbox, ops_bot)
    assert f"circuits opened: 1 ({scope})" in texts[0]
    assert f"circuits closed: 1 ({scope})" in texts[1]


def test_the_sweeper_sends_the_digest(bot, ops_bot) -> None:
    failed_row(bot)
    report = sweeper.sweep()
    assert report["ops_digests"] == 1
    assert len(digests(ops_bot)) == 1


def test_the_digest_goes_by_email_and_to_a_developers_notifier_with_the_same_throttle(bot, settings) -> None:
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.DOVECOTE_OPS_EMAILS = ["ops@example.com"]
    settings.DOVECOTE_OPS_NOTIFIERS = ["tests.reconciliation.test_ops_digest.collect"]
    received.clear()
    failed_row(bot, reason_class="permanent")
    now = timezone.now()
    digest.flush(now)
    failed_row(bot, reason_class="permanent")
    digest.flush(now + timedelta(seconds=10))

    assert len(mail.outbox) == 1
    assert mail.outbox[0].to == ["ops@example.com"]
    assert "permanent: 1" in mail.outbox[0].body
    assert [(r["kind"], r["counts"]) for r in received] == [("dead_letters", {"permanent": 1})]


def test_the_ops_bot_does_not_report_on_its_own_dead_letters_or_circuit(bot, ops_bot) -> None:
    failed_row(ops_bot)
    circuits.open_for_auth(f"bot:{ops_bot.pk}", reason="token refused")
    assert digest.flush(timezone.now() + timedelta(seconds=1)) == []
    assert digests(ops_bot) == []


def test_a_broken_ops_bot_does_not_hold_up_the_bot_it_reports_on(bot, ops_bot, sandbox) -> None:
    sandbox.fault("401", token=ops_bot.token)
    failed_row(bot)
    digest.flush(timezone.now())
    (ops_message,) = digests(ops_bot)
    _, ops_message = drive(ops_message.pk)
    assert ops_message.state != State.SENT
    assert Circuit.objects.get(scope=circuits.bot_scope(ops_bot.pk)).state == CircuitState.OPEN

    _, reply = drive(enqueue(bot, chat_id=5, text="your order").pk)
    assert reply.state == State.SENT
    assert sandbox.sent_texts(token=bot.token) == ["your order"]
    # The next window's flush runs and adds nothing about the ops bot's own trouble.
    assert digest.flush(timezone.now() + timedelta(minutes=5)) == []


def texts_to(sandbox, ops, chat: int) -> list[str]:
    for message in digests(ops):
        drive(message.pk)
    return [
        call["params"]["text"]
        for call in sandbox.calls(token=ops.token, method="sendMessage")
        if call["params"]["chat_id"] == chat
    ]


def test_a_bots_own_ops_chat_hears_of_that_bot_alone_once_per_window(bot_factory, ops_bot, sandbox) -> None:
    client_chat = 555001
    client = bot_factory(name="clientbot", ops_chat_id=client_chat)
    other = bot_factory(name="otherbot")
    failed_row(client, reason_class="permanent")
    failed_row(other, reason_class="transient")
    now = timezone.now()
    digest.flush(now)
    failed_row(client, reason_class="permanent")
    digest.flush(now + timedelta(seconds=30))  # the bot's chat window is taken: it waits

    (own,) = texts_to(sandbox, ops_bot, client_chat)
    assert "for bot clientbot" in own
    assert "1 new dead letter:" in own
    assert "permanent: 1" in own
    assert "transient" not in own  # the other bot's trouble is not this client's
    (everything,) = texts_to(sandbox, ops_bot, OPS_CHAT)
    assert "permanent: 1" in everything
    assert "transient: 1" in everything

    digest.flush(now + timedelta(minutes=5))
    later = texts_to(sandbox, ops_bot, client_chat)
    assert len(later) == 2
    assert "permanent: 1" in later[1]


def test_a_bots_own_ops_chat_works_without_a_global_chat_and_hears_of_its_circuit(
    bot_factory, ops_bot, sandbox, settings
) -> None:
    settings.DOVECOTE_OPS_CHAT_ID = ""
    client_chat = 555002
    client = bot_factory(name="clientbot2", ops_chat_id=client_chat)
    circuits.open_for_auth(circuits.bot_scope(client.pk), reason="token refused")
    digest.flush(timezone.now() + timedelta(seconds=1))

    (text,) = texts_to(sandbox, ops_bot, client_chat)
    assert f"circuits opened: 1 ({circuits.bot_scope(client.pk)})" in text
    assert texts_to(sandbox, ops_bot, OPS_CHAT) == []
