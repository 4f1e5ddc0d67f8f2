"""Operations endpoints: /healthz, /readyz, /metrics."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.support import METRICS_AUTH, Process, launch_worker, wait_until

pytestmark = pytest.mark.django_db


def test_healthz_says_the_process_is_alive(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"ok": True}


def test_readyz_checks_database_and_broker(client: Client) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"] == {"database": "ok", "broker": "ok"}


def test_readyz_is_503_when_the_broker_is_unreachable(client: Client, settings) -> None:
    settings.REDIS_URL = settings.CELERY_BROKER_URL = "redis://127.0.0.1:9/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["broker"].startswith("unavailable")


@pytest.mark.django_db(transaction=True)
def test_readyz_is_503_when_postgresql_does_not_answer(client: Client) -> None:
    from django.db import connection

    port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = 9  # nothing listens there
    try:
        response = client.get("/readyz")
    finally:
        connection.close()
        connection.settings_dict["PORT"] = port
    assert response.status_code == 503
    assert response.json()["checks"]["database"] == "unavailable: OperationalError"
    assert client.get("/readyz").json()["checks"]["database"] == "ok"  # the next ping reconnects


def test_readyz_checks_a_rabbitmq_broker_and_redis_separately(client: Client, settings) -> None:
    from tests.conftest import RABBITMQ_URL

    settings.CELERY_BROKER_URL = RABBITMQ_URL
    response = client.get("/readyz")
    assert (response.status_code, response.json()["checks"]) == (
        200,
        {"database": "ok", "broker": "ok", "redis": "ok"},
    )

    # RabbitMQ down: not ready. Redis down alone: shown, but the webhook still stores and answers.
    settings.CELERY_BROKER_URL = "amqp://guest:guest@127.0.0.1:9//"
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["broker"].startswith("unavailable: ")
    settings.CELERY_BROKER_URL, settings.REDIS_URL = RABBITMQ_URL, "redis://127.0.0.1:9/0"
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"]["redis"].startswith("unavailable: ")


def test_metrics_exports_backlog_in_prometheus_text_format(client: Client, bot) -> None:
    from outbox.services import outbound_message_enqueue

    outbound_message_enqueue(bot_id=bot.pk, chat_id=7, payload={"text": "hi"}, idempotency_key="m1")

    response = client.get("/metrics", headers=METRICS_AUTH)

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    body = response.content.decode()
    assert 'dovecote_outbox_items{state="pending"} 1.0' in body
    assert "dovecote_dead_letters_open 0.0" in body
    assert "dovecote_reconciliation_cases_open 0.0" in body


def test_the_api_docs_and_admin_load_nothing_from_a_cdn(admin_client: Client) -> None:
    import re

    for url in ("/api/docs/", "/admin/", "/admin/ops/dashboard/"):
        html = admin_client.get(url).content.decode()
        external = re.findall(r"""(?:src|href)=["'](https?://[^"']+)""", html)
        assert external == [], f"{url} loads {external}"


def test_the_openapi_schema_and_docs_follow_the_apis_authentication(client: Client, admin_client: Client, bot) -> None:
    from tests.outbox.helpers import api_client

    assert client.get("/api/schema/").status_code == 401
    assert client.get("/api/docs/").status_code == 401
    response = api_client("alice", bot).get("/api/schema/")
    assert response.status_code == 200
    assert b"/api/v1/messages/" in response.content
    assert admin_client.get("/api/docs/").status_code == 200


def test_a_send_lease_shorter_than_a_send_is_refused_by_the_system_check() -> None:
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    # Defaults: 5 s connect, 15 s read: a send may take 5 + 2 x 15 + 5 + 5.25 s; the lease is 60.
    call_command("check", "--tag", "dovecote")
    with override_settings(DOVECOTE_SEND_LEASE_SECONDS=30), pytest.raises(SystemCheckError, match=r"dovecote\.E001"):
        call_command("check", "--tag", "dovecote")
    with override_settings(DOVECOTE_SEND_LEASE_SECONDS=30, DOVECOTE_TELEGRAM_READ_TIMEOUT=5):
        call_command("check", "--tag", "dovecote")


@pytest.mark.e2e
def test_a_worker_refuses_to_start_with_a_send_lease_shorter_than_a_send(
    process_env: dict[str, str], processes: list[Process]
) -> None:
    # `migrate` refuses it, but the worker is what holds the lease: it started and sent anyway.
    worker = launch_worker({**process_env, "DOVECOTE_SEND_LEASE_SECONDS": "30"}, name="worker-short-lease")
    processes.append(worker)

    wait_until(lambda: not worker.alive() or "ready." in worker.log(), timeout=30, message="the worker to exit")
    assert worker.proc.poll() == 1, worker.log()
    [line] = [line for line in worker.log().splitlines() if "DOVECOTE_SEND_LEASE_SECONDS" in line]
    assert line.startswith("dovecote: refusing to start the worker: (dovecote.E001) DOVECOTE_SEND_LEASE_SECONDS=30 ")
    assert "ready." not in worker.log()
    assert "Traceback" not in worker.log()


@pytest.mark.parametrize(
    ("token", "debug", "header", "status"),
    [
        ("", True, "", 200),
        ("", False, "", 403),
        ("s3cret", False, "", 401),
        ("s3cret", False, "Bearer wrong", 401),
        ("s3cret", False, "Bearer s3cret", 200),
        ("s3cret", True, "", 401),
    ],
)
def test_metrics_need_the_bearer_token(client: Client, db, token: str, debug: bool, header: str, status: int) -> None:
    from django.test import override_settings

    headers = {"Authorization": header} if header else {}
    with override_settings(DOVECOTE_METRICS_TOKEN=token, DEBUG=debug):
        response = client.get("/metrics", headers=headers)
    assert response.status_code == status
    assert (b"dovecote_outbox_items" in response.content) == (status == 200)
