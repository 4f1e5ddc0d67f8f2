"""Privacy: payload retention, and logs that never carry tokens, phone numbers or text."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from outbox import services
from outbox.models import OutboundMessage, State
from tests.outbox.helpers import drive, enqueue

pytestmark = pytest.mark.django_db


def test_sent_payloads_past_retention_lose_text_and_markup_but_keep_metadata(bot, sandbox) -> None:
    markup = {"inline_keyboard": [[{"text": "Pay", "callback_data": "pay:7"}]]}
    old = enqueue(bot, chat_id=1, text="Your code is 4711")
    OutboundMessage.objects.filter(pk=old.pk).update(
        payload={"text": "Your code is 4711", "parse_mode": "HTML", "reply_markup": markup}
    )
    recent = enqueue(bot, chat_id=2, text="recent")
    waiting = enqueue(bot, chat_id=3, text="not sent yet")
    drive(old.pk)
    drive(recent.pk)
    OutboundMessage.objects.filter(pk__in=[old.pk, waiting.pk]).update(
        sent_at=timezone.now() - timedelta(days=settings.DOVECOTE_PAYLOAD_RETENTION_DAYS + 1)
    )

    assert services.outbound_messages_purge_payloads() == 1
    assert services.outbound_messages_purge_payloads() == 0

    old.refresh_from_db()
    assert old.payload == {"parse_mode": "HTML"}
    assert old.payload_purged_at is not None
    assert (old.state, old.chat_id, old.attempts) == (State.SENT, 1, 1)
    assert old.telegram_message_id is not None
    assert old.idempotency_key
    assert OutboundMessage.objects.get(pk=recent.pk).payload == {"text": "recent"}
    assert OutboundMessage.objects.get(pk=waiting.pk).payload == {"text": "not sent yet"}


@pytest.fixture
def json_log() -> io.StringIO:
    """The project's own console handler (JSON formatter + filters), writing to a buffer."""
    stream = io.StringIO()
    config = json.loads(json.dumps(settings.LOGGING))
    config["handlers"]["console"]["stream"] = stream
    config["handlers"]["console"]["class"] = "logging.StreamHandler"
    logging.config.dictConfig(config)
    yield stream
    logging.config.dictConfig(settings.LOGGING)


def test_logs_mask_tokens_phone_numbers_and_message_text(json_log) -> None:
    token = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"
    logger = logging.getLogger("outbox.test")

    logger.warning("POST https://api.telegram.org/bot%s/sendMessage", token)
    logger.warning("user left phone +7 912 345-67-89 for a callback")
    logger.warning("payload %s", {"chat_id": 5, "text": "my secret diagnosis", "caption": "holiday photo"})

    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    output = json_log.getvalue()
    assert len(lines) == 3
    assert token not in output
    assert "AAHdqTcv" not in output
    assert "912 345" not in output
    assert "secret diagnosis" not in output
    assert "holiday photo" not in output
    assert "<token>" in lines[0]["message"]
    assert "<phone>" in lines[1]["message"]
    assert "chat_id" in lines[2]["message"]


def test_a_failed_send_logs_no_token_and_no_text(json_log, bot, sandbox) -> None:
    sandbox.fault("400", token=bot.token)
    message = enqueue(bot, text="Dear Bob, your results: negative")

    drive(message.pk)

    output = json_log.getvalue()
    assert "failed: permanent" in output
    assert bot.token not in output
    assert "your results" not in output


def test_a_logged_traceback_and_extra_fields_are_masked_too(json_log) -> None:
    """Found from outside: python-json-logger formats the traceback again from the exception,
    so a failed call's traceback carried the bot token and the text."""
    token = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"
    logger = logging.getLogger("outbox.test")
    try:
        raise RuntimeError(f"POST /bot{token}/sendMessage failed: {{'text': 'my secret diagnosis'}}")
    except RuntimeError:
        logger.exception("send failed", extra={"data": {"url": f"/bot{token}/x", "phone": "+7 912 345-67-89"}})

    output = json_log.getvalue()
    [line] = [json.loads(x) for x in output.splitlines()]
    assert "RuntimeError" in line["exc_info"]
    assert "<token>" in line["exc_info"]
    assert line["data"] == {"url": "/bot<token>/x", "phone": "<phone>"}
    assert token not in output
    assert "secret diagnosis" not in output
    assert "912 345" not in output
    assert line["time"][:4].isdigit()  # the formatter's own fields stay as they are
