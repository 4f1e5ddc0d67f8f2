"""Who may see and do what: every door (the webhook, the API, the admin and its actions, the
dashboard, /metrics, the schema) against every role, with the answer each must get, in one
table. A change of any answer is a change of who may do what, and fails here."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from outbox.models import Circuit, OutboundMessage
from reconciliation.models import ReconciliationCase
from tests.outbox.helpers import api_client
from tests.reconciliation.factories import message_row
from tests.reconciliation.triage_helpers import failed_row, persona
from tests.support import METRICS_AUTH

pytestmark = pytest.mark.django_db

ROLES = ["anonymous", "client_a", "client_b", "operator", "developer", "superuser"]
SECRET = "matrix-secret"


@pytest.fixture
def world(bot_factory):
    """Two shops with a message each, a dead letter and a case in shop A, and every role."""
    shop_a = bot_factory(name="shop-a", webhook_secret=SECRET)
    shop_b = bot_factory(name="shop-b", webhook_secret=SECRET)
    letter = failed_row(shop_a)
    case = ReconciliationCase.objects.create(message=message_row(shop_a, key="case", state="unknown"), policy="hold")
    circuit = Circuit.objects.create(scope=f"bot:{shop_a.pk}")
    clients: dict[str, Client] = {"anonymous": APIClient()}
    clients["client_a"] = api_client("client-a", shop_a, payload_access=False)
    clients["client_b"] = api_client("client-b", shop_b, payload_access=False)
    for role, group in (("operator", "Operator"), ("developer", "Developer")):
        client = APIClient()
        client.force_login(persona(role, group))
        clients[role] = client
    root = APIClient()
    root.force_login(persona("root", superuser=True))
    clients["superuser"] = root
    messages = {
        bot.name: OutboundMessage.objects.create(
            bot=bot,
            chat_id=1,
            payload={"text": "x"},
            idempotency_key=f"m-{bot.name}",
            next_attempt_at="2030-01-01T00:00Z",
        )
        for bot in (shop_a, shop_b)
    }
    return {
        "a": shop_a,
        "b": shop_b,
        "letter": letter,
        "case": case,
        "circuit": circuit,
        "clients": clients,
        "messages": messages,
    }


def _webhook(w, client):
    update = {"update_id": 1, "message": {"message_id": 1, "date": 0, "chat": {"id": 1, "type": "private"}}}
    return Client().post(
        f"/webhooks/telegram/{w['a'].name}/",
        data=json.dumps(update),
        content_type="application/json",
        headers={"X-Telegram-Bot-Api-Secret-Token": SECRET},
    )


def _send(bot_key: str):
    def send(w, client):
        body = {"bot": w[bot_key].name, "chat_id": 9, "payload": {"text": "hi"}}
        return client.post("/api/v1/messages/", body, format="json", HTTP_IDEMPOTENCY_KEY=f"k-{bot_key}")

    return send


def _broadcast(w, client):
    body = {"bot": w["a"].name, "chat_ids": [1, 2], "payload": {"text": "sale"}}
    return client.post("/api/v1/broadcasts/", body, format="json", HTTP_IDEMPOTENCY_KEY="b")


def _get_message(bot_name: str):
    return lambda w, client: client.get(f"/api/v1/messages/{w['messages'][bot_name].pk}/")


def _cancel(bot_name: str):
    def cancel(w, client):
        # A message of its own for each role, so that one role's cancel does not answer another's.
        bot = w["a"] if bot_name == "shop-a" else w["b"]
        message = message_row(bot, key=f"cancel-{OutboundMessage.objects.count()}", chat_id=2)
        return client.post(f"/api/v1/messages/{message.pk}/cancel/", {}, format="json")

    return cancel


def _get(url_of):
    return lambda w, client: client.get(url_of(w))


def _metrics(with_token: bool):
    """/metrics is guarded by its bearer token whoever asks; a role's own session or API token
    (which the role's client would send instead of the bearer) opens nothing there."""

    def scrape(w, client):
        if with_token:
            return Client().get("/metrics", headers=METRICS_AUTH)
        return client.get("/metrics")

    return scrape


# door: (anonymous, client A, client B, operator, developer, superuser)
MATRIX = {
    "webhook with the bot's secret": (_webhook, (200, 200, 200, 200, 200, 200)),
    "send through shop A": (_send("a"), (401, 201, 403, 403, 403, 201)),
    "send through shop B": (_send("b"), (401, 403, 201, 403, 403, 201)),
    "broadcast through shop A": (_broadcast, (401, 201, 403, 403, 403, 201)),
    "read shop A's message": (_get_message("shop-a"), (401, 200, 404, 404, 404, 200)),
    "cancel shop A's message": (_cancel("shop-a"), (401, 200, 404, 404, 404, 200)),
    "API schema": (lambda w, c: c.get("/api/schema/"), (401, 200, 200, 200, 200, 200)),
    "API docs": (lambda w, c: c.get("/api/docs/"), (401, 200, 200, 200, 200, 200)),
    "metrics without the token": (_metrics(False), (401, 401, 401, 401, 401, 401)),
    "metrics with the token": (_metrics(True), (200, 200, 200, 200, 200, 200)),
    "admin index": (_get(lambda w: reverse("admin:index")), (302, 302, 302, 200, 200, 200)),
    "dead letters": (_get(lambda w: reverse("admin:outbox_deadletter_changelist")), (302, 302, 302, 200, 200, 200)),
    "a dead letter": (
        _get(lambda w: reverse("admin:outbox_deadletter_change", args=[w["letter"].pk])),
        (302, 302, 302, 200, 200, 200),
    ),
    "retry a dead letter (confirmation)": (
        _get(lambda w: reverse("admin:outbox_deadletter_retry", args=[w["letter"].pk])),
        (302, 302, 302, 200, 200, 200),
    ),
    "a reconciliation case": (
        _get(lambda w: reverse("admin:reconciliation_reconciliationcase_change", args=[w["case"].pk])),
        (302, 302, 302, 200, 200, 200),
    ),
    "a bot": (_get(lambda w: reverse("admin:bots_bot_change", args=[w["a"].pk])), (302, 302, 302, 200, 200, 200)),
    "add a bot": (_get(lambda w: reverse("admin:bots_bot_add")), (302, 302, 302, 403, 200, 200)),
    "a circuit": (
        _get(lambda w: reverse("admin:outbox_circuit_change", args=[w["circuit"].pk])),
        (302, 302, 302, 200, 200, 200),
    ),
    "pause a bot (confirmation)": (
        _get(lambda w: reverse("dovecote_circuit", args=["pause"]) + f"?scope=bot:{w['a'].pk}"),
        (302, 302, 302, 200, 200, 200),
    ),
    "API clients": (_get(lambda w: reverse("admin:outbox_apiclient_changelist")), (302, 302, 302, 403, 403, 200)),
    "dashboard": (_get(lambda w: reverse("dovecote_dashboard")), (302, 302, 302, 200, 200, 200)),
}


@pytest.mark.parametrize("door", list(MATRIX))
def test_every_role_gets_the_answer_it_must_at_every_door(world, door: str) -> None:
    request, expected = MATRIX[door]
    got = {}
    for role in ROLES:
        got[role] = request(world, world["clients"][role]).status_code
    assert got == dict(zip(ROLES, expected, strict=True))
