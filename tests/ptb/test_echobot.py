"""Acceptance 1: python-telegram-bot's echobot.py, unmodified but for its import line, run as
a Dovecote consumer (serial="chat") by a real Celery worker that SIGKILLs itself at one
crash point (DOVECOTE_FAILPOINTS, core/failpoints.py); a fresh worker and the sweeper (run
here, as beat would) finish the work. 5 chats x 20 messages: each chat gets exactly one echo
per message, in order.

The crash points of a handling, in the order it passes them:
- `ptb_after_journal`: the journal row and its outbox message are committed, nothing sent;
- `before_request`: the outbox's attempt row is committed, the request never left;
- `after_response`: Telegram answered (the echo is in the chat), nothing of it recorded;
- `ptb_before_commit`: the answer is recorded, the run's completion is not;
- `ptb_after_commit`: the run is done.
A kill at `before_request` or `after_response` leaves the send `unknown` with an open case
(nobody can tell whether it arrived); the operator here looks at the chat and decides it:
delivered after `after_response` (no second send), resend after `before_request`.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from bots.models import ConsumerRun, RunState
from bots.ptb.models import HandlerCall
from outbox.models import OutboundMessage
from reconciliation import services as reconciliation_services
from reconciliation.models import CaseStatus, ReconciliationCase
from tests.ptb.support import ptb_worker, sweep_once, user_writes
from tests.support import Process, wait_until

pytestmark = [pytest.mark.e2e]

CHATS = [9101, 9102, 9103, 9104, 9105]
PER_CHAT = 20


def sweep_and_decide(bot, operator) -> None:
    """One sweep (no redispatch grace), then the operator's decision on each open case: the
    chat shows whether the message arrived."""
    sweep_once()
    for case in ReconciliationCase.objects.filter(status=CaseStatus.OPEN, message__bot=bot):
        if delivered(case.message):
            reconciliation_services.case_mark_delivered(case, operator, "the echo is in the chat")
        else:
            reconciliation_services.case_resend(case, operator, "not in the chat")


def delivered(message: OutboundMessage) -> bool:
    from bots.sandbox.client import SandboxClient

    client = SandboxClient(message.bot.api_base_url)
    texts = client.sent_texts(token=message.bot.token, chat_id=message.chat_id)
    return message.payload.get("text") in texts


@pytest.mark.parametrize(
    "point", ["ptb_after_journal", "before_request", "after_response", "ptb_before_commit", "ptb_after_commit"]
)
def test_each_chat_gets_one_echo_per_message_in_order_with_a_worker_killed_at(
    point: str, process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    bot = bot_factory(name="ptb-echo", responder="none")
    operator = get_user_model().objects.create_user("olga", password="x")
    doomed = ptb_worker(process_env, processes, failpoint=point, name=f"doomed-{point}")
    for n in range(PER_CHAT):
        for chat_id in CHATS:
            user_writes(sandbox, bot, chat_id, f"chat {chat_id} message {n}")
    wait_until(lambda: not doomed.alive(), timeout=60, message=f"the worker to kill itself at {point}")

    ptb_worker(process_env, processes, name=f"fresh-{point}")
    runs = ConsumerRun.objects.filter(consumer="ptb_echo")

    def finished() -> bool:
        sweep_and_decide(bot, operator)
        return runs.filter(state=RunState.DONE).count() == len(CHATS) * PER_CHAT

    wait_until(finished, timeout=180, interval=1.0, message="every run done")

    for chat_id in CHATS:
        assert sandbox.sent_texts(token=bot.token, chat_id=chat_id) == [
            f"chat {chat_id} message {n}" for n in range(PER_CHAT)
        ]
    assert HandlerCall.objects.filter(consumer="ptb_echo", ok=True).count() == len(CHATS) * PER_CHAT
    cases = ReconciliationCase.objects.filter(message__bot=bot)
    if point in ("before_request", "after_response"):
        # One unknown send, decided by looking at the chat: delivered (no second send) when
        # the request had left, resent when it had not.
        case = cases.get()
        assert case.status != CaseStatus.OPEN
        assert case.message.attempt_set.count() == (1 if point == "after_response" else 2)
    else:
        assert not cases.exists()
    assert not runs.exclude(attempts__lte=2).exists()
