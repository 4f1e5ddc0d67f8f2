"""Whatever an operator types into the admin gets an answer, never a 500: the audit's cases
(issue #41), each with the answer a user gets."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

from bots.models import AnalyticsEvent, ChatState
from outbox.models import ApiClient, Circuit, Effect
from reconciliation.models import AuditEntry, BulkRetry, PayloadVersion, ReconciliationCase
from tests.reconciliation.factories import message_row
from tests.reconciliation.triage_helpers import failed_row, failed_run, logged_in, persona

pytestmark = pytest.mark.django_db


@pytest.fixture
def root(bot_factory) -> Client:
    """A superuser's session, and a row of each of the project's models (the installed apps'
    have theirs from the migrations, or none)."""
    bot = bot_factory()
    letter = failed_row(bot)
    update = failed_run(bot).consumer_run.update
    message = message_row(bot, key="unknown", state="unknown")
    ReconciliationCase.objects.create(message=message, idempotency_key="unknown")
    PayloadVersion.objects.create(message=message, number=1, payload={"text": "x"})
    BulkRetry.objects.create(reason="x", item_ids=[letter.pk], total=1)
    Circuit.objects.create(scope=f"bot:{bot.pk}")
    Effect.objects.create(key="eff:1", state="done")
    AnalyticsEvent.objects.create(bot=bot, update=update, received_at=timezone.now())
    ChatState.objects.create(bot=bot, chat_id=1, last_answered_at=timezone.now() - timedelta(days=1))
    user = persona("root", superuser=True)
    AuditEntry.objects.create(actor=user, action="x", target="y")
    ApiClient.objects.create(user=persona("api"))
    return logged_in(user)


def answer(client: Client, method: str, path: str, params: dict[str, Any]) -> int:
    """The status of one request, made in a savepoint that is rolled back: every example
    starts from the same rows, and a database error in the view reaches the test, not the
    next example."""
    with transaction.atomic():
        status = getattr(client, method)(path, params).status_code
        transaction.set_rollback(True)
    return status


# The audit's cases (issue #41) and their kin, each with the answer a user gets: an empty
# result, the admin's "does not exist" redirect, a 400 or a 404.
FOUND = [
    ("get", "/admin/outbox/outboundmessage/", {"q": "²"}, 200),
    ("get", "/admin/outbox/deadletter/", {"q": "--5"}, 200),
    ("get", "/admin/bots/inboundupdate/", {"q": "²"}, 200),
    ("get", "/admin/outbox/outboundmessage/²/change/", {}, 302),
    ("get", "/admin/outbox/outboundmessage/--5/change/", {}, 302),
    ("get", "/admin/bots/bot/²/change/", {}, 302),
    ("get", "/admin/ops/dashboard/", {"bot": "999999"}, 404),
    ("get", "/admin/ops/dashboard/data.json", {"bot": "999999"}, 404),
    ("get", "/admin/ops/dashboard/fragment/", {"bot": "²"}, 400),
    ("get", "/admin/ops/circuit/pause/", {"scope": "bot:²"}, 404),
    ("post", "/admin/ops/circuit/pause/?scope=bot:--5", {"reason": "typo"}, 404),
]


@pytest.mark.parametrize(("method", "path", "params", "status"), FOUND)
def test_input_that_was_a_500_gets_its_answer(root, method: str, path: str, params: dict, status: int) -> None:
    assert answer(root, method, path, params) == status
