"""After a Bot API outage the backlog leaves through the drain in the order it was written,
with no sweeper running: the circuit's probe closes it and the release sends what waited.

Found from outside (bench/recovery.py --only 502: the backlog's pace 0.72 of the bot's
limit): the replies the outage failed were made due at the close, behind everything written
before it, so their chats were served last and their later replies trickled out at the
chat's 1/s once the rest had gone, the bot's other slots unused."""

from __future__ import annotations

import time

import pytest

from outbox.models import Attempt, Circuit, CircuitState, OutboundMessage, State
from outbox.services import outbound_messages_enqueue
from tests.support import Process, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

LIMIT = 30  # the bot's, enforced by the sandbox as Telegram does, with 1/s per private chat
PER_CHAT = 3
# Longer than the outage lasts here, as a backoff grows in a longer one: each failed reply
# still waits it out when the circuit closes.
RETRY_BASE_SECONDS = "60"
OUTAGE_SECONDS = 3.0


def _replies(bot, chats: list[int], numbers: range) -> list[dict]:
    return [
        {
            "bot_id": bot.pk,
            "chat_id": chat,
            "payload": {"text": f"reply {n} to chat {chat}"},
            "idempotency_key": f"outage-{chat}-{n}",
        }
        for n in numbers
        for chat in chats
    ]


def test_after_an_outage_the_replies_it_failed_go_first_and_the_rest_in_the_order_written(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(rate_limit=LIMIT)
    sandbox.limits(per_bot_per_second=LIMIT, per_private_chat_per_second=1)
    sandbox.fault("5xx", status=502, token=bot.token)
    # No celery-beat: nothing but the probe and the drain brings the backlog back.
    processes.append(start_worker({**process_env, "DOVECOTE_RETRY_BASE_SECONDS": RETRY_BASE_SECONDS}))
    scope = f"bot:{bot.pk}"
    early = [9100 + n for n in range(12)]  # their first replies meet the outage
    later = [9200 + n for n in range(30)]  # written while the circuit is open
    outbound_messages_enqueue(_replies(bot, early, range(1)))
    wait_until(
        lambda: Circuit.objects.filter(scope=scope, state=CircuitState.OPEN).exists(),
        timeout=30,
        message="the outage opening the bot's circuit",
    )
    failed = set(Attempt.objects.filter(message__bot=bot).values_list("message__chat_id", flat=True))
    assert len(failed) >= 10  # the failures that opened it
    outbound_messages_enqueue(_replies(bot, early, range(1, PER_CHAT)) + _replies(bot, later, range(PER_CHAT)))
    # The outage lasts a few seconds more: longer than the turn of its chat each failed
    # request took (Telegram may have counted it).
    time.sleep(OUTAGE_SECONDS)

    sandbox.clear_faults()
    total = (len(early) + len(later)) * PER_CHAT
    wait_until(
        lambda: OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == total,
        timeout=60,
        interval=0.5,
        message="every reply sent after the outage, without a sweeper",
    )

    for chat in early + later:
        expected = [f"reply {n} to chat {chat}" for n in range(PER_CHAT)]
        assert sandbox.sent_texts(token=bot.token, chat_id=chat) == expected  # each once, in order
    # Telegram's limits held: no 429 (it would have paused the whole bot).
    assert not [c for c in sandbox.calls(token=bot.token) if c.get("status") == 429]
    # The replies the outage failed were written first: they go before any chat written
    # after them has its first reply, not behind the whole backlog.
    order = [c["params"]["text"] for c in sandbox.calls(token=bot.token, method="sendMessage") if c["delivered"]]
    last_failed = max(order.index(f"reply 0 to chat {chat}") for chat in failed)
    first_later = min(order.index(f"reply 0 to chat {chat}") for chat in later)
    assert last_failed < first_later, order[: len(early) + 5]
