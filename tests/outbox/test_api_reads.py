"""What the REST API returns is what the README says: a message reads back with the key the
client sent, a trace id, its attempts counted and listed; and a client lists its bots'
messages, a page at a time, filtered by bot and state. Bad query parameters are a 400 that
says what is wrong, never a 5xx."""

from __future__ import annotations

import base64
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from outbox.models import OutboundMessage, State
from tests.outbox.helpers import api_client
from tests.reconciliation.factories import message_row

pytestmark = pytest.mark.django_db


@pytest.fixture
def shops(bot_factory):
    return bot_factory(name="alice-shop"), bot_factory(name="bob-shop")


@pytest.fixture
def alice(shops) -> APIClient:
    return api_client("alice", shops[0])


def send(client: APIClient, bot, key: str, chat_id: int = 77):
    body = {"bot": bot.name, "chat_id": chat_id, "payload": {"text": "Your order shipped"}}
    return client.post("/api/v1/messages/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_a_message_reads_back_with_the_clients_key_a_trace_id_and_its_attempts(shops) -> None:
    alice_shop, _ = shops
    alice = api_client("alice", alice_shop)

    created = send(alice, alice_shop, "order-1042-shipped").json()
    read = alice.get(f"/api/v1/messages/{created['id']}/").json()

    for body in (created, read):
        assert body["idempotency_key"] == "order-1042-shipped"
        assert re.fullmatch(r"[0-9a-f]{32}", body["trace_id"])
        assert body["attempts"] == 0  # a count, of max_attempts
        assert body["attempts_list"] == []  # each attempt, with its outcome
    assert read["trace_id"] == created["trace_id"]
    assert OutboundMessage.objects.get(pk=created["id"]).trace_id == created["trace_id"]


def test_a_broadcast_answers_with_the_clients_key_and_its_messages_share_a_trace_id(shops) -> None:
    alice_shop, _ = shops
    alice = api_client("alice", alice_shop)

    answer = alice.post(
        "/api/v1/broadcasts/",
        {"bot": alice_shop.name, "chat_ids": [1, 2], "payload": {"text": "sale"}},
        format="json",
        HTTP_IDEMPOTENCY_KEY="spring-sale",
    ).json()
    first = alice.get(f"/api/v1/messages/{answer['message_ids'][0]}/").json()

    assert answer["broadcast"] == "spring-sale"
    assert first["broadcast"] == "spring-sale"
    assert first["idempotency_key"] == "bc:spring-sale:1"
    traces = set(OutboundMessage.objects.values_list("trace_id", flat=True))
    assert len(traces) == 1
    assert re.fullmatch(r"[0-9a-f]{32}", traces.pop())


def test_the_list_shows_a_clients_bots_messages_newest_first_a_page_at_a_time(shops) -> None:
    alice_shop, bob_shop = shops
    alice = api_client("alice", alice_shop)
    ids = [send(alice, alice_shop, f"k{n}", chat_id=n).json()["id"] for n in range(5)]
    message_row(bob_shop, key="bobs")

    page = alice.get("/api/v1/messages/", {"limit": 2})
    assert page.status_code == 200
    body = page.json()
    assert [m["id"] for m in body["results"]] == ids[:-3:-1]
    assert body["results"][0]["idempotency_key"] == "k4"
    seen = [m["id"] for m in body["results"]]
    while body["next"]:
        body = alice.get(body["next"]).json()
        seen += [m["id"] for m in body["results"]]
    assert seen == ids[::-1]  # bob's message is not alice's to see


def test_the_list_filters_by_bot_and_state(shops, django_user_model) -> None:
    alice_shop, bob_shop = shops
    alice = api_client("alice", alice_shop)
    failed = message_row(alice_shop, key="f", state=State.FAILED, last_error="Forbidden", last_error_class="permanent")
    retry = message_row(alice_shop, key="r", state=State.RETRY)
    message_row(alice_shop, key="s", state=State.SENT)
    message_row(bob_shop, key="b", state=State.FAILED)

    def listed(**query) -> list[int]:
        response = alice.get("/api/v1/messages/", query)
        assert response.status_code == 200, response.content
        return [m["id"] for m in response.json()["results"]]

    assert listed(bot="alice-shop", state="failed") == [failed.pk]
    assert listed(state="failed,retry") == [retry.pk, failed.pk]
    assert len(alice.get("/api/v1/messages/?state=failed&state=retry").json()["results"]) == 2
    root = django_user_model.objects.create_superuser("root", password="x")
    admin = APIClient()
    admin.force_authenticate(root)
    assert len(admin.get("/api/v1/messages/", {"state": "failed"}).json()["results"]) == 2


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ({"state": "lost"}, "state", "lost"),
        ({"bot": "nobody"}, "bot", "unknown bot 'nobody'"),
        ({"bot": "x" * 65}, "bot", "1-64 characters"),
        ({"limit": "0"}, "limit", "1"),
        ({"limit": "many"}, "limit", "integer"),
        ({"limit": "201"}, "limit", "200"),
        ({"chat_id": "²"}, "chat_id", "integer"),
        ({"cursor": "not-a-cursor"}, "cursor", "invalid"),
        ({"cursor": base64.b64encode(b"p=abc").decode()}, "cursor", "invalid"),  # ours in form, not in value
        ({"cursor": base64.b64encode(b"p=99999999999999999999").decode()}, "cursor", "invalid"),
    ],
)
def test_a_bad_list_query_is_a_400_that_says_what_is_wrong(shops, query, field, says) -> None:
    alice = api_client("alice", shops[0])
    response = alice.get("/api/v1/messages/", query)
    assert response.status_code == 400, response.content
    assert says in str(response.json()[field])


def test_listing_a_bot_the_client_may_not_use_is_403(shops) -> None:
    alice = api_client("alice", shops[0])
    response = alice.get("/api/v1/messages/", {"bot": "bob-shop"})
    assert response.status_code == 403
    assert "bob-shop" in str(response.json()["bot"])


query_values = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["failed", "failed,retry", ",", "-1", "²", "\x00", "9" * 30, "cD1hYmM=", "bz0tMQ==", "1e3"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=st.dictionaries(st.sampled_from(["bot", "state", "chat_id", "limit", "cursor"]), query_values))
def test_no_list_query_gets_a_5xx(alice, query) -> None:
    response = alice.get("/api/v1/messages/", query)
    assert response.status_code in (200, 400, 403), (query, response.content)


def test_the_openapi_schema_describes_the_list_without_a_warning(tmp_path) -> None:
    from django.core.management import call_command

    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yml"))
    schema = (tmp_path / "schema.yml").read_text()
    assert "operationId: v1_messages_list" in schema
