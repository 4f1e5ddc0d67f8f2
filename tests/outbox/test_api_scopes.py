"""Each REST API client to its own bots: it sends only through the bots it is granted, sees
and cancels only their messages (404 otherwise), and reads payloads only with payload access.
Found from outside: any token could read any message with its text, cancel it, and send
through any bot."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from core.masking import MASK
from outbox.models import ApiClient, OutboundMessage, State
from tests.outbox.helpers import api_client

pytestmark = pytest.mark.django_db


def send(client: APIClient, bot, key: str, text: str = "Your code is 4411"):
    body = {"bot": bot.name, "chat_id": 77, "payload": {"text": text}}
    return client.post("/api/v1/messages/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


@pytest.fixture
def shops(bot_factory):
    return bot_factory(name="alice-shop"), bot_factory(name="bob-shop")


def test_a_client_may_not_send_through_a_bot_it_is_not_granted(shops) -> None:
    alice_shop, bob_shop = shops
    alice = api_client("alice", alice_shop)

    refused = send(alice, bob_shop, "k1")
    broadcast = alice.post(
        "/api/v1/broadcasts/",
        {"bot": bob_shop.name, "chat_ids": [1, 2], "payload": {"text": "sale"}},
        format="json",
        HTTP_IDEMPOTENCY_KEY="b1",
    )

    assert (refused.status_code, broadcast.status_code) == (403, 403)
    assert "bob-shop" in refused.json()["bot"][0]
    assert not OutboundMessage.objects.exists()
    assert send(alice, alice_shop, "k1").status_code == 201  # the key was not spent


def test_a_client_sees_and_cancels_only_the_messages_of_its_bots(shops) -> None:
    alice_shop, bob_shop = shops
    alice, bob = api_client("alice", alice_shop), api_client("bob", bob_shop)
    message_id = send(alice, alice_shop, "k1").json()["id"]

    assert bob.get(f"/api/v1/messages/{message_id}/").status_code == 404
    assert bob.post(f"/api/v1/messages/{message_id}/cancel/", {"reason": "mine now"}, format="json").status_code == 404
    assert OutboundMessage.objects.get(pk=message_id).state == State.PENDING
    assert alice.get(f"/api/v1/messages/{message_id}/").status_code == 200
    assert alice.post(f"/api/v1/messages/{message_id}/cancel/", {}, format="json").status_code == 200


def test_payloads_are_masked_without_payload_access(shops) -> None:
    alice_shop, _ = shops
    writer = api_client("writer", alice_shop, payload_access=True)
    reader = api_client("reader", alice_shop, payload_access=False)
    created = send(writer, alice_shop, "k1", text="Dear Bob, your results: negative")
    message_id = created.json()["id"]

    seen = reader.get(f"/api/v1/messages/{message_id}/").json()

    assert created.json()["payload"] == {"text": "Dear Bob, your results: negative"}
    assert seen["payload"] == {"text": MASK}
    assert (seen["chat_id"], seen["state"]) == (77, "pending")


def test_a_payloads_nested_values_are_masked_too_but_its_ids_and_types_show(shops) -> None:
    alice_shop, _ = shops
    writer = api_client("writer", alice_shop, payload_access=True)
    reader = api_client("reader", alice_shop, payload_access=False)
    media = [{"type": "photo", "media": "AgAD-file-id", "caption": "Bob's scan, 12 Baker St"}] * 2
    body = {"bot": alice_shop.name, "chat_id": 77, "method": "sendMediaGroup", "payload": {"media": media}}
    created = writer.post("/api/v1/messages/", body, format="json", HTTP_IDEMPOTENCY_KEY="album")
    assert created.status_code == 201, created.json()

    seen = reader.get(f"/api/v1/messages/{created.json()['id']}/").json()

    assert seen["payload"] == {"media": [{"type": "photo", "media": MASK, "caption": MASK}] * 2}


def test_a_superuser_may_use_every_bot(shops, django_user_model) -> None:
    from rest_framework.authtoken.models import Token

    root = django_user_model.objects.create_superuser("root", "root@example.com", "x")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=root).key}")
    assert send(client, shops[1], "k1").status_code == 201


def test_add_api_client_grants_bots_prints_a_token_and_updates_in_place(shops) -> None:
    out = StringIO()
    call_command("add_api_client", "crm", "--bot", "alice-shop", stdout=out)
    token = out.getvalue().split("Token: ")[1].split()[0]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert send(client, shops[0], "k1").status_code == 201
    assert send(client, shops[1], "k2").status_code == 403

    call_command("add_api_client", "crm", "--bot", "bob-shop", "--payload-access", stdout=StringIO())
    crm = ApiClient.objects.get(user__username="crm")
    assert (list(crm.bots.values_list("name", flat=True)), crm.payload_access) == (["bob-shop"], True)
    assert send(client, shops[1], "k3").status_code == 201  # the same token

    with pytest.raises(CommandError, match="unknown bot"):
        call_command("add_api_client", "crm", "--bot", "nobody", stdout=StringIO())


def broadcast(client: APIClient, bot, key: str):
    body = {"bot": bot.name, "chat_ids": [77, 78], "payload": {"text": "Your code is 4411"}}
    return client.post("/api/v1/broadcasts/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_a_replay_after_the_clients_grant_was_removed_is_403_as_a_new_request_is(shops) -> None:
    alice_shop, _ = shops
    alice = api_client("alice", alice_shop)
    message = send(alice, alice_shop, "k1")
    sale = broadcast(alice, alice_shop, "b1")
    assert (message.status_code, sale.status_code) == (201, 201)

    call_command("add_api_client", "alice", "--bot", "bob-shop", stdout=StringIO())  # alice-shop taken away

    replayed = send(alice, alice_shop, "k1")
    replayed_sale = broadcast(alice, alice_shop, "b1")
    assert (replayed.status_code, replayed_sale.status_code) == (403, 403)
    assert "4411" not in replayed.content.decode()
    assert "alice-shop" in replayed.json()["bot"][0]
    assert alice.get(f"/api/v1/messages/{message.json()['id']}/").status_code == 404
    assert OutboundMessage.objects.count() == 3


def test_a_replay_after_payload_access_was_removed_masks_the_payload(shops) -> None:
    alice_shop, _ = shops
    alice = api_client("alice", alice_shop, payload_access=True)
    first = send(alice, alice_shop, "k1")
    assert first.json()["payload"] == {"text": "Your code is 4411"}

    ApiClient.objects.filter(user__username="alice").update(payload_access=False)

    replayed = send(alice, alice_shop, "k1")
    assert (replayed.status_code, replayed["Idempotent-Replayed"]) == (200, "true")
    assert replayed.json()["payload"] == {"text": MASK}
    assert {k: v for k, v in replayed.json().items() if k != "payload"} == {
        k: v for k, v in first.json().items() if k != "payload"
    }
    assert alice.get(f"/api/v1/messages/{first.json()['id']}/").json()["payload"] == {"text": MASK}
