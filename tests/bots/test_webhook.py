"""The webhook's behaviour (docs/ARCHITECTURE.md), case by case, against the real PostgreSQL."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext

from bots import inbox
from bots.models import Bot, InboundUpdate, UpdateState

pytestmark = pytest.mark.django_db


def message_update(update_id: int, text: str = "hello", chat_id: int = 4242) -> dict:
    return {
        "update_id": update_id,
        "message": {
            "message_id": update_id,
            "date": 1_700_000_000,
            "chat": {"id": chat_id, "type": "private", "first_name": "Alice"},
            "from": {"id": chat_id, "is_bot": False, "first_name": "Alice"},
            "text": text,
        },
    }


SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"


@pytest.fixture
def bot(bot_factory):
    """Every bot has a webhook secret (add_bot makes one); these tests run with DEBUG off."""
    return bot_factory(webhook_secret="alices-webhook-secret")


def post(client: Client, bot, body, *, secret: bool = True, **headers):
    """POST as Telegram does: with the bot's secret token unless `secret=False`."""
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    if secret and bot.webhook_secret:
        headers.setdefault(SECRET_HEADER, bot.webhook_secret)
    return client.post(bot.webhook_path, data=data, content_type="application/json", headers=headers)


def test_it_stores_an_update_and_answers_200(client: Client, bot) -> None:
    response = post(client, bot, message_update(1, "hi there"))

    assert response.status_code == 200
    assert response.json() == {"ok": True}
    update = InboundUpdate.objects.get(bot=bot, update_id=1)
    assert update.state == UpdateState.NEW
    assert update.update_type == "message"
    assert update.chat_id == 4242
    assert update.user_id == 4242
    assert update.message_id == 1
    assert update.payload["message"]["text"] == "hi there"
    assert len(update.trace_id) == 32


def test_trace_ids_sort_in_the_order_the_updates_came(client: Client, bot) -> None:
    # Time-ordered (core/ids.py): the trace_id indexes of the hot tables grow at one edge,
    # and an operator's list sorted by trace id is in the order the updates came.
    for update_id in range(1, 4):
        assert post(client, bot, message_update(update_id)).status_code == 200
        time.sleep(0.002)

    traces = list(InboundUpdate.objects.filter(bot=bot).order_by("update_id").values_list("trace_id", flat=True))
    assert traces == sorted(traces)
    assert len(set(traces)) == 3
    made_at_ms = int(traces[-1][:12], 16)
    assert abs(made_at_ms - time.time() * 1000) < 60_000


def test_a_redelivered_update_answers_200_and_is_stored_once(client: Client, bot) -> None:
    first = post(client, bot, message_update(7, "first"))
    again = post(client, bot, message_update(7, "changed on redelivery"))

    assert first.status_code == again.status_code == 200
    assert InboundUpdate.objects.filter(bot=bot, update_id=7).count() == 1
    assert InboundUpdate.objects.get(bot=bot, update_id=7).payload["message"]["text"] == "first"


def test_the_same_update_id_for_two_bots_is_two_updates(client: Client, bot_factory) -> None:
    alice_bot, bob_bot = bot_factory(webhook_secret="alices"), bot_factory(webhook_secret="bobs")
    assert post(client, alice_bot, message_update(5)).status_code == 200
    assert post(client, bob_bot, message_update(5)).status_code == 200
    assert InboundUpdate.objects.filter(update_id=5).count() == 2


@pytest.mark.parametrize("given", [None, "wrong-secret", "s3cret-tok3n-but-longer"])
def test_a_missing_or_wrong_secret_is_403_and_nothing_is_stored(client: Client, bot_factory, given) -> None:
    secured = bot_factory(webhook_secret="s3cret-tok3n")
    headers = {} if given is None else {"X-Telegram-Bot-Api-Secret-Token": given}

    response = post(client, secured, message_update(1), secret=False, **headers)

    assert response.status_code == 403
    assert not InboundUpdate.objects.exists()


def test_the_right_secret_is_accepted(client: Client, bot_factory) -> None:
    secured = bot_factory(webhook_secret="s3cret-tok3n")
    response = post(client, secured, message_update(1), **{"X-Telegram-Bot-Api-Secret-Token": "s3cret-tok3n"})
    assert response.status_code == 200
    assert InboundUpdate.objects.count() == 1


def test_an_unknown_bot_is_404(client: Client, bot) -> None:
    response = client.post(
        "/webhooks/telegram/nobody/", data=json.dumps(message_update(1)), content_type="application/json"
    )
    assert response.status_code == 404
    assert not InboundUpdate.objects.exists()


def test_an_inactive_bot_is_404(client: Client, bot_factory) -> None:
    sleeping = bot_factory(is_active=False)
    assert post(client, sleeping, message_update(1)).status_code == 404
    assert not InboundUpdate.objects.exists()


def test_a_stored_update_costs_one_statement_after_the_first(client: Client, bot) -> None:
    # The hot path: no bot lookup (cached per process) and no re-read of the inserted row.
    post(client, bot, message_update(1))
    with CaptureQueriesContext(connection) as queries:
        assert post(client, bot, message_update(2)).status_code == 200
    statements = [q["sql"] for q in queries.captured_queries if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))]
    assert len(statements) == 1
    assert statements[0].startswith("INSERT INTO")
    assert "ON CONFLICT" in statements[0]
    assert InboundUpdate.objects.filter(bot=bot).count() == 2


def test_the_webhook_goes_ahead_of_the_admins_middleware_but_keeps_the_sites_rules(client: Client, bot) -> None:
    # The admin's stack (sessions, CSRF, clickjacking headers) is not the webhook's: no cookie,
    # no CSRF token needed, and the update is stored.
    response = post(client, bot, message_update(1))
    assert (response.status_code, response.cookies) == (200, {})
    assert InboundUpdate.objects.filter(bot=bot, update_id=1).exists()
    assert client.get("/admin/login/").headers["X-Frame-Options"] == "DENY"  # the stack still runs there
    # A site that sends plain HTTP to HTTPS sends the webhook too.
    with override_settings(SECURE_SSL_REDIRECT=True):
        fresh = Client()  # its middleware is built under the setting
        assert post(fresh, bot, message_update(2)).status_code == 301
        assert (
            fresh.post(
                bot.webhook_path,
                json.dumps(message_update(3)),
                "application/json",
                secure=True,
                **{"HTTP_" + SECRET_HEADER.upper().replace("-", "_"): bot.webhook_secret},
            ).status_code
            == 200
        )
    assert not InboundUpdate.objects.filter(bot=bot, update_id=2).exists()


@pytest.mark.parametrize(
    "path",
    [
        "/webhooks/telegram/shop/",
        "/webhooks/telegram/shop-bot_2/",
        "/webhooks/telegram/shop",
        "/webhooks/telegram//",
        "/webhooks/telegram/shop/extra/",
        "/webhooks/telegram/",
        "/admin/webhooks/telegram/shop/",
    ],
)
def test_the_middlewares_webhook_route_is_the_url_confs(path: str) -> None:
    from django.urls import Resolver404, resolve

    from bots.middleware import WEBHOOK_PATH
    from bots.views import telegram_webhook

    try:
        match = resolve(path)
        routed = match.kwargs["name"] if match.func is telegram_webhook else None
    except Resolver404:
        routed = None
    fast = WEBHOOK_PATH.fullmatch(path)
    assert (fast["name"] if fast else None) == routed


def test_a_bot_deactivated_or_given_a_new_secret_is_refused_at_once_here_and_soon_elsewhere(
    client: Client, bot, monkeypatch
) -> None:
    assert post(client, bot, message_update(1)).status_code == 200  # now cached
    bot.webhook_secret = "a-new-secret"
    bot.save()  # saved in this process: forgotten at once
    assert post(client, bot, message_update(2), **{SECRET_HEADER: "alices-webhook-secret"}).status_code == 403
    assert post(client, bot, message_update(3)).status_code == 200

    # Another process deactivates it (no signal reaches this one): refused once the cache
    # entry is older than BOT_CACHE_SECONDS.
    monkeypatch.setattr(inbox, "BOT_CACHE_SECONDS", 0.2)
    inbox.forget_bot()
    assert post(client, bot, message_update(4)).status_code == 200
    Bot.objects.filter(pk=bot.pk).update(is_active=False)
    time.sleep(0.3)
    assert post(client, bot, message_update(5)).status_code == 404
    assert sorted(InboundUpdate.objects.values_list("update_id", flat=True)) == [1, 3, 4]


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        b"\xff\xfe\x00garbage",
        b"[1, 2, 3]",
        b'"just a string"',
        b"{}",
        b'{"update_id": "12"}',
        b'{"update_id": 1.5}',
        b'{"update_id": true}',
        b'{"update_id": null}',
        b'{"update_id": 99999999999999999999999}',
        b"",
    ],
)
def test_a_body_that_is_not_an_update_is_400_and_nothing_is_stored(client: Client, bot, body: bytes) -> None:
    response = post(client, bot, body)
    assert response.status_code == 400
    assert response.json()["ok"] is False
    assert not InboundUpdate.objects.exists()


def test_a_nul_character_postgres_cannot_store_is_400_not_500(client: Client, bot) -> None:
    response = post(client, bot, b'{"update_id": 3, "message": {"text": "a\\u0000b"}}')
    assert response.status_code == 400
    assert not InboundUpdate.objects.exists()


def nested(depth: int, *, update_id: int) -> bytes:
    """An update whose body nests `depth` levels in all (the update object is level 1), built
    as text: json.dumps itself recurses once per level."""
    inner = depth - 1
    return (f'{{"update_id": {update_id}, "message": ' + '{"a": ' * (inner - 1) + "{}" + "}" * inner).encode()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 100_000, id="100000 open brackets"),
        pytest.param(nested(10_000, update_id=4), id="an update 10000 objects deep"),
        pytest.param(nested(65, update_id=4), id="an update one level past the limit"),
    ],
)
def test_a_body_nested_too_deep_is_400_not_500_and_nothing_is_stored(client: Client, bot, body: bytes) -> None:
    response = post(client, bot, body)

    assert response.status_code == 400
    assert response.json() == {"ok": False, "error": "body nested deeper than 64 levels"}
    assert not InboundUpdate.objects.exists()


def test_an_update_nested_as_deep_as_the_limit_is_stored(client: Client, bot) -> None:
    assert post(client, bot, nested(64, update_id=5)).status_code == 200

    payload = InboundUpdate.objects.get(bot=bot, update_id=5).payload
    assert json.dumps(payload).count("{") == 64


def test_an_update_with_more_brackets_than_the_depth_limit_but_shallow_is_stored(client: Client, bot) -> None:
    # 70 entities and braces in the text: more opening brackets than 64, three levels deep.
    update = message_update(6, text="{[" * 40)
    update["message"]["entities"] = [{"type": "bold", "offset": i, "length": 1} for i in range(70)]

    assert post(client, bot, update).status_code == 200

    assert InboundUpdate.objects.get(bot=bot, update_id=6).payload == update


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-32"])
def test_an_update_is_stored_as_it_was_sent_in_any_encoding_json_allows(client: Client, bot, encoding: str) -> None:
    update = message_update(7, text='Привет 👋 "quoted" \\ back\nslash')
    body = json.dumps(update, ensure_ascii=False).encode(encoding)

    assert post(client, bot, body).status_code == 200

    stored = InboundUpdate.objects.get(bot=bot, update_id=7)
    assert stored.payload == update
    assert stored.chat_id == 4242


@override_settings(DOVECOTE_WEBHOOK_MAX_BYTES=1024)
def test_a_body_over_the_limit_is_413_and_nothing_is_stored(client: Client, bot) -> None:
    response = post(client, bot, message_update(1, "x" * 2000))
    assert response.status_code == 413
    assert not InboundUpdate.objects.exists()


@pytest.mark.parametrize("method", ["get", "put", "patch", "delete"])
def test_any_method_but_post_is_405(client: Client, bot, method: str) -> None:
    response = getattr(client, method)(bot.webhook_path)
    assert response.status_code == 405
    assert response["Allow"] == "POST"


@pytest.mark.e2e
def test_twenty_concurrent_deliveries_of_one_update_store_one_row(web: str, bot_factory) -> None:
    bot = bot_factory()
    body = json.dumps(message_update(77))

    def deliver(_: int) -> int:
        return httpx.post(
            f"{web}{bot.webhook_path}", content=body, headers={"Content-Type": "application/json"}
        ).status_code

    with ThreadPoolExecutor(max_workers=20) as pool:
        statuses = list(pool.map(deliver, range(20)))

    assert statuses == [200] * 20
    assert InboundUpdate.objects.filter(bot=bot, update_id=77).count() == 1


@pytest.mark.e2e
def test_a_dropped_database_connection_costs_the_webhook_no_update(
    process_env: dict, processes: list, bot_factory
) -> None:
    # The webhook skips Django's per-request health check (a SELECT 1): a connection that
    # PostgreSQL dropped is found by the INSERT itself, replaced, and the update stored.
    from tests.support import start_web

    bot = bot_factory()
    proc, url = start_web(process_env, name="web-dropped")
    processes.append(proc)
    statuses = [
        httpx.post(f"{url}{bot.webhook_path}", json=message_update(n), timeout=10).status_code for n in range(20)
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert cursor.fetchone()[0] >= 1  # the web's connections

    statuses += [
        httpx.post(f"{url}{bot.webhook_path}", json=message_update(n), timeout=10).status_code for n in range(20, 40)
    ]

    assert statuses == [200] * 40
    assert InboundUpdate.objects.filter(bot=bot).count() == 40


@pytest.mark.e2e
def test_the_database_down_is_503_never_200(process_env: dict, processes: list, bot_factory) -> None:
    from tests.support import start_web

    bot = bot_factory()
    # A database URL nobody answers on: the web process cannot store anything.
    env = {**process_env, "DATABASE_URL": "postgres://postgres@127.0.0.1:9/nowhere", "DATABASE_CONNECT_TIMEOUT": "1"}
    proc, url = start_web(env, name="web-nodb")
    processes.append(proc)

    response = httpx.post(f"{url}{bot.webhook_path}", json=message_update(1), timeout=10)

    assert response.status_code == 503
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 503
    assert not InboundUpdate.objects.exists()


@pytest.mark.e2e
def test_the_broker_down_still_answers_200_with_the_row_committed(
    process_env: dict, processes: list, bot_factory
) -> None:
    from tests.support import start_web

    bot = bot_factory()
    env = {**process_env, "REDIS_URL": "redis://127.0.0.1:9/0"}
    proc, url = start_web(env, name="web-noredis")
    processes.append(proc)

    response = httpx.post(f"{url}{bot.webhook_path}", json=message_update(11), timeout=20)

    assert response.status_code == 200
    assert InboundUpdate.objects.get(bot=bot, update_id=11).state == UpdateState.NEW
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 503


@pytest.mark.e2e
def test_rabbitmq_down_still_answers_200_without_waiting_for_it_with_the_row_committed(
    process_env: dict, processes: list, bot_factory
) -> None:
    from tests.support import start_web

    bot = bot_factory()
    env = {**process_env, "CELERY_BROKER_URL": "amqp://guest:guest@127.0.0.1:9//"}
    proc, url = start_web(env, name="web-norabbit")
    processes.append(proc)

    response = httpx.post(f"{url}{bot.webhook_path}", json=message_update(12), timeout=20)

    assert response.status_code == 200
    # The router's wake-up waits for the broker (CELERY_BROKER_CONNECTION_TIMEOUT, 2 s) in a
    # thread of the web process, not in the request.
    assert response.elapsed.total_seconds() < 1.5
    assert InboundUpdate.objects.get(bot=bot, update_id=12).state == UpdateState.NEW
    ready = httpx.get(f"{url}/readyz", timeout=10)
    assert ready.status_code == 503
    assert ready.json()["checks"]["broker"].startswith("unavailable: ")
    assert ready.json()["checks"]["redis"] == "ok"


def test_a_bot_without_a_webhook_secret_is_refused_unless_debug_is_on(client: Client, bot_factory) -> None:
    bare = bot_factory()  # made before secrets were generated, or by hand

    assert post(client, bare, message_update(1)).status_code == 403
    assert not InboundUpdate.objects.exists()
    with override_settings(DEBUG=True):
        assert post(client, bare, message_update(1)).status_code == 200
    assert InboundUpdate.objects.count() == 1


def test_trace_ids_differ_across_forked_processes_and_calls() -> None:
    # gunicorn forks its workers from one master: each child draws its own trace ids.
    import multiprocessing

    from bots.inbox import new_trace_id

    with multiprocessing.get_context("fork").Pool(2) as pool:
        drawn = pool.map(_trace_ids, [50, 50])
    ids = [*drawn[0], *drawn[1], *_trace_ids(50)]

    assert len(set(ids)) == 150
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert new_trace_id() != new_trace_id()


def _trace_ids(n: int) -> list[str]:
    from bots.inbox import new_trace_id

    return [new_trace_id() for _ in range(n)]
