"""The REST API, as docs/API.md describes it: token auth, Idempotency-Key semantics, message
status, cancel, broadcasts and the OpenAPI schema."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from outbox import idempotency, services
from outbox.models import IdempotencyRecord, OutboundMessage, State
from outbox.sending import batch
from reconciliation.sweeper import sweep
from tests.outbox.helpers import api_client, drive, limiter_redis_at
from tests.support import free_port, queued

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(bot) -> APIClient:
    return api_client("alice", bot)


def post_message(client: APIClient, body: dict, key: str | None = "order-1-confirmation"):
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    return client.post("/api/v1/messages/", body, format="json", **headers)


def body_for(bot, **extra) -> dict:
    return {"bot": bot.name, "chat_id": 4242, "payload": {"text": "Your order is confirmed"}, **extra}


def test_the_api_requires_a_token(bot) -> None:
    response = APIClient().post("/api/v1/messages/", body_for(bot), format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert response.status_code == 401


def test_a_new_key_creates_the_message_201(alice, bot) -> None:
    response = post_message(alice, body_for(bot, send_at="2030-01-01T10:00:00Z", on_ambiguous="resend"))

    assert response.status_code == 201
    data = response.json()
    message = OutboundMessage.objects.get(pk=data["id"])
    assert (data["state"], data["bot"], data["chat_id"], data["method"]) == ("pending", bot.name, 4242, "sendMessage")
    assert message.payload == {"text": "Your order is confirmed"}
    assert message.on_ambiguous == "resend"
    assert message.send_at.year == 2030


def test_the_same_key_and_body_replays_the_first_answer_200(alice, bot) -> None:
    first = post_message(alice, body_for(bot))
    again = post_message(alice, body_for(bot))

    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    assert again["Idempotent-Replayed"] == "true"
    assert OutboundMessage.objects.count() == 1


def test_replay_of_a_finished_request_after_its_message_was_sent_is_200_with_the_first_answer_and_sends_nothing(
    alice, bot, sandbox
) -> None:
    first = post_message(alice, body_for(bot))
    assert drive(first.json()["id"])[1].state == State.SENT

    again = post_message(alice, body_for(bot))

    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()  # the first answer, not the message's state now
    assert again["Idempotent-Replayed"] == "true"
    assert OutboundMessage.objects.count() == 1
    assert drive(first.json()["id"])[0].status == "not-waiting"
    assert sandbox.sent_texts(token=bot.token) == ["Your order is confirmed"]


def test_the_same_key_with_another_body_is_422(alice, bot) -> None:
    post_message(alice, body_for(bot))
    response = post_message(alice, body_for(bot, chat_id=9999))

    assert response.status_code == 422
    assert OutboundMessage.objects.count() == 1


def test_the_same_key_with_another_body_is_422_after_its_request_record_was_purged(alice, bot) -> None:
    post_message(alice, body_for(bot))
    IdempotencyRecord.objects.all().delete()  # retention keeps records for a while, messages longer
    response = post_message(alice, body_for(bot, chat_id=9999))

    assert response.status_code == 422
    assert OutboundMessage.objects.count() == 1
    assert post_message(alice, body_for(bot)).status_code == 200  # the same body is still a replay


def test_the_same_key_while_the_first_request_is_in_progress_is_409(alice, bot) -> None:
    body = body_for(bot)
    # The first request has claimed the key and not answered yet.
    begun = idempotency.idempotency_begin(
        scope=f"user:{alice.user.pk}:messages",
        key="slow-1",
        fingerprint=idempotency.request_fingerprint(body),
        user=alice.user,
    )
    assert begun.outcome == "new"

    response = post_message(alice, body, key="slow-1")

    assert response.status_code == 409
    assert not OutboundMessage.objects.exists()


@pytest.mark.parametrize("key", [None, "", "k" * 256, "\x00", "tab\tkey", "half a pair \ud83d"])
def test_a_missing_or_invalid_key_is_400(alice, bot, key) -> None:
    response = post_message(alice, body_for(bot), key=key)

    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["detail"]
    assert not OutboundMessage.objects.exists()


def test_a_key_of_255_characters_is_accepted(alice, bot) -> None:
    assert post_message(alice, body_for(bot), key="k" * 255).status_code == 201


def test_two_clients_may_use_the_same_key(alice, bot) -> None:
    bob = api_client("bob", bot)

    assert post_message(alice, body_for(bot), key="same").status_code == 201
    assert post_message(bob, body_for(bot), key="same").status_code == 201
    assert OutboundMessage.objects.count() == 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"bot": "nobody"}, "bot"),
        ({"bot": "shop\x00"}, "bot"),  # no name holds a NUL, and PostgreSQL cannot be asked
        ({"chat_id": "abc"}, "chat_id"),
        ({"chat_id": 2**63}, "chat_id"),
        ({"method": "launchRocket"}, "method"),
        ({"payload": "text"}, "payload"),
        ({"payload": {"text": ""}}, "payload"),
        ({"payload": {"text": "a\x00b"}}, "payload"),  # PostgreSQL's jsonb refuses a NUL
        # A long text is split (tests/outbox/test_long_messages.py); a long caption cannot be.
        ({"method": "sendPhoto", "payload": {"photo": "f", "caption": "x" * 1025}}, "payload"),
        ({"payload": {"text": "*x* " * 3000, "parse_mode": "MarkdownV2"}}, "payload"),
        ({"on_ambiguous": "maybe"}, "on_ambiguous"),
        ({"send_at": "tomorrow"}, "send_at"),
        ({"send_at": "2030-01-02T00:00:00Z", "expires_at": "2030-01-01T00:00:00Z"}, "expires_at"),
    ],
)
def test_invalid_bodies_are_400_with_field_errors_and_free_the_key(alice, bot, change, field) -> None:
    response = post_message(alice, {**body_for(bot), **change}, key="fix-and-retry")

    assert response.status_code == 400
    assert field in response.json()
    # Nothing was stored, so the corrected request may reuse the key.
    assert post_message(alice, body_for(bot), key="fix-and-retry").status_code == 201


def test_an_inactive_bot_is_400_for_a_client_granted_it(bot, bot_factory) -> None:
    sleeping = bot_factory(is_active=False)
    response = post_message(api_client("carol", bot, sleeping), body_for(sleeping))
    assert response.status_code == 400
    assert "inactive" in response.json()["bot"][0]


def test_an_inactive_bot_the_client_is_not_granted_is_403(alice, bot_factory) -> None:
    # Scope first: whether a bot it may not use is active is none of the client's business.
    assert post_message(alice, body_for(bot_factory(is_active=False))).status_code == 403


def test_get_shows_state_attempts_last_error_and_telegram_message_id(alice, bot, sandbox) -> None:
    sandbox.fault("5xx", count=1, token=bot.token)
    created = post_message(alice, body_for(bot)).json()
    drive(created["id"])

    data = alice.get(f"/api/v1/messages/{created['id']}/").json()

    assert data["state"] == "sent"
    assert data["attempts"] == 2
    assert data["telegram_message_id"] == sandbox.messages(token=bot.token)[0]["message_id"]
    assert [a["outcome"] for a in data["attempts_list"]] == ["transient", "ok"]
    assert data["attempts_list"][0]["http_status"] == 502
    assert alice.get("/api/v1/messages/999999/").status_code == 404


def test_get_shows_the_last_error_and_its_class(alice, bot, sandbox) -> None:
    sandbox.fault("403", token=bot.token)
    created = post_message(alice, body_for(bot)).json()
    drive(created["id"])

    data = alice.get(f"/api/v1/messages/{created['id']}/").json()

    assert (data["state"], data["last_error_class"]) == ("failed", "permanent")
    assert "blocked" in data["last_error"]


def test_cancel_is_200_while_pending_and_409_once_sent(alice, bot, sandbox) -> None:
    waiting = post_message(alice, body_for(bot, chat_id=1), key="a").json()
    sent = post_message(alice, body_for(bot, chat_id=2), key="b").json()
    drive(sent["id"])

    ok = alice.post(f"/api/v1/messages/{waiting['id']}/cancel/", {"reason": "customer cancelled"}, format="json")
    refused = alice.post(f"/api/v1/messages/{sent['id']}/cancel/", format="json")

    assert ok.status_code == 200
    assert (ok.json()["state"], ok.json()["cancel_reason"]) == ("cancelled", "customer cancelled")
    assert refused.status_code == 409
    assert refused.json()["state"] == "sent"
    assert alice.post("/api/v1/messages/999999/cancel/").status_code == 404


def test_a_broadcast_makes_one_unordered_message_per_chat_with_derived_keys(alice, bot) -> None:
    body = {"bot": bot.name, "chat_ids": [11, 12, 13, 12], "payload": {"text": "Sale starts now"}}
    response = alice.post("/api/v1/broadcasts/", body, format="json", HTTP_IDEMPOTENCY_KEY="sale-2030")
    replay = alice.post("/api/v1/broadcasts/", body, format="json", HTTP_IDEMPOTENCY_KEY="sale-2030")

    assert response.status_code == 201
    data = response.json()
    assert (data["count"], data["created"]) == (3, 3)
    messages = OutboundMessage.objects.filter(pk__in=data["message_ids"])
    assert sorted(m.chat_id for m in messages) == [11, 12, 13]
    assert data["broadcast"] == "sale-2030"  # the key as the client sent it
    stored = services.client_key(client=str(alice.user.pk), key="sale-2030")
    assert all(not m.ordered and m.broadcast == stored for m in messages)
    assert {m.idempotency_key for m in messages} == {
        services.broadcast_message_key(stored, chat) for chat in (11, 12, 13)
    }
    assert (replay.status_code, replay.json()) == (200, data)
    assert OutboundMessage.objects.count() == 3


def post_broadcast(client: APIClient, body: dict, key: str = "sale-2030"):
    return client.post("/api/v1/broadcasts/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def purge_idempotency_records() -> None:
    """Retention, as the sweeper runs it, once the records are past their 24 hours."""
    IdempotencyRecord.objects.update(created_at=timezone.now() - timedelta(hours=25))
    assert idempotency.idempotency_records_prune() >= 1


def test_a_broadcast_key_with_another_payload_is_422_before_and_after_its_record_is_purged(alice, bot) -> None:
    first = {"bot": bot.name, "chat_ids": [11, 12], "payload": {"text": "Sale starts now"}}
    second = {"bot": bot.name, "chat_ids": [11, 12, 13], "payload": {"text": "Sale cancelled"}}
    assert post_broadcast(alice, first).status_code == 201

    while_kept = post_broadcast(alice, second)
    purge_idempotency_records()
    after_purge = post_broadcast(alice, second)
    one_chat = post_broadcast(alice, {**second, "chat_ids": [12]})

    assert (while_kept.status_code, after_purge.status_code, one_chat.status_code) == (422, 422, 422)
    assert "different request body" in after_purge.json()["detail"]
    # Not one chat got the second text, not even chat 13, which the first broadcast had not.
    assert sorted((m.chat_id, m.payload["text"]) for m in OutboundMessage.objects.all()) == [
        (11, "Sale starts now"),
        (12, "Sale starts now"),
    ]
    replay = post_broadcast(alice, first)
    assert (replay.status_code, replay.json()["created"], replay.json()["count"]) == (200, 0, 2)


def test_a_broadcast_replay_with_its_record_kept_is_200_with_the_first_answer(alice, bot) -> None:
    body = {"bot": bot.name, "chat_ids": [11, 12], "payload": {"text": "Sale starts now"}}
    first = post_broadcast(alice, body)
    again = post_broadcast(alice, body)

    assert (first.status_code, again.status_code, again["Idempotent-Replayed"]) == (201, 200, "true")
    assert again.json() == first.json()
    assert OutboundMessage.objects.count() == 2


def test_the_broadcast_service_refuses_a_key_used_with_another_call_and_writes_nothing(bot) -> None:
    services.broadcast_enqueue(bot_id=bot.pk, chat_ids=[1, 2], payload={"text": "x"}, broadcast_key="b1")

    with pytest.raises(services.IdempotencyConflict):
        services.broadcast_enqueue(bot_id=bot.pk, chat_ids=[2, 3], payload={"text": "y"}, broadcast_key="b1")
    with pytest.raises(services.IdempotencyConflict):
        services.broadcast_enqueue(
            bot_id=bot.pk, chat_ids=[1], payload={"text": "x"}, broadcast_key="b1", method="editMessageText"
        )

    assert sorted(OutboundMessage.objects.values_list("chat_id", "payload")) == [(1, {"text": "x"}), (2, {"text": "x"})]


def test_a_broadcast_needs_a_key_and_valid_chats(alice, bot) -> None:
    body = {"bot": bot.name, "chat_ids": [1], "payload": {"text": "hi"}}
    assert alice.post("/api/v1/broadcasts/", body, format="json").status_code == 400
    empty = alice.post("/api/v1/broadcasts/", {**body, "chat_ids": []}, format="json", HTTP_IDEMPOTENCY_KEY="b")
    assert empty.status_code == 400
    assert "chat_ids" in empty.json()


def test_a_broadcast_while_redis_is_down_is_stored_201_and_the_sweeper_sends_it_later(alice, bot, sandbox) -> None:
    body = {"bot": bot.name, "chat_ids": [21, 22, 23], "payload": {"text": "Sale starts now"}}
    with limiter_redis_at(f"redis://127.0.0.1:{free_port()}/0"):  # nothing listens there
        response = alice.post("/api/v1/broadcasts/", body, format="json", HTTP_IDEMPOTENCY_KEY="sale-redis-down")

    assert response.status_code == 201, response.content
    data = response.json()
    messages = OutboundMessage.objects.filter(pk__in=data["message_ids"])
    assert (data["created"], messages.count()) == (3, 3)
    # No slot was reserved: each is due now, in its row, for the sweeper (or a drain).
    assert {m.state for m in messages} == {State.PENDING}
    assert all(m.next_attempt_at <= timezone.now() for m in messages)

    # Redis is back: the sweeper wakes the bot's broadcast drain (on the bulk queue, not one
    # task per message), which sends each once.
    with override_settings(DOVECOTE_REDISPATCH_GRACE_SECONDS=0):
        assert sweep()["broadcast_drains_woken"] == 1
    assert queued() == []
    bulk = queued(settings.CELERY_TASK_QUEUE_BULK)
    assert [(t.name, t.args) for t in bulk] == [("outbox.drain_broadcasts", [bot.pk])]
    assert batch.outbound_broadcasts_drain(bot.pk).sent == 3
    assert {m.state for m in messages.all()} == {State.SENT}
    assert sorted(c["chat_id"] for c in sandbox.calls(token=bot.token, method="sendMessage")) == [21, 22, 23]


def test_the_broadcast_service_called_twice_creates_nothing_new(bot) -> None:
    first = services.broadcast_enqueue(bot_id=bot.pk, chat_ids=[1, 2], payload={"text": "x"}, broadcast_key="b1")
    again = services.broadcast_enqueue(bot_id=bot.pk, chat_ids=[1, 2, 3], payload={"text": "x"}, broadcast_key="b1")

    assert (first.created, again.created) == (2, 1)
    assert again.message_ids[:2] == first.message_ids


def test_the_openapi_schema_is_served(alice) -> None:
    response = alice.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")

    assert response.status_code == 200
    paths = response.json()["paths"]
    expected = {"/api/v1/messages/", "/api/v1/messages/{id}/", "/api/v1/messages/{id}/cancel/", "/api/v1/broadcasts/"}
    assert expected <= set(paths)


def test_idempotency_records_are_kept_at_least_24_hours(alice, bot) -> None:
    from datetime import timedelta

    from django.utils import timezone

    post_message(alice, body_for(bot), key="young")
    post_message(alice, body_for(bot, chat_id=1), key="old")
    IdempotencyRecord.objects.filter(key="old").update(created_at=timezone.now() - timedelta(hours=25))

    # Asking to prune everything still keeps the last 24 hours.
    assert idempotency.idempotency_records_prune(older_than=timezone.now()) == 1
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["young"]


def test_a_stale_in_progress_key_is_taken_over(alice, bot) -> None:
    from datetime import timedelta

    from django.utils import timezone

    body = body_for(bot)
    idempotency.idempotency_begin(
        scope=f"user:{alice.user.pk}:messages",
        key="crashed",
        fingerprint=idempotency.request_fingerprint(body),
        user=alice.user,
    )
    IdempotencyRecord.objects.filter(key="crashed").update(created_at=timezone.now() - timedelta(minutes=5))

    assert post_message(alice, body, key="crashed").status_code == 201
    assert OutboundMessage.objects.get().state == State.PENDING
