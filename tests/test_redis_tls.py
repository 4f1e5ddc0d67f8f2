"""Redis over TLS (`rediss://`, as Heroku Redis gives, with a self-signed certificate): one
setting, REDIS_SSL_CERT_REQS, for the broker, the limiter, the drain's keys and /readyz.
Against a real redis-server with a TLS port and a certificate made here."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.core.management import call_command
from django.test import Client

from outbox.models import OutboundMessage, State
from tests.support import Process, free_port, require_tool, start_web, start_worker, wait_until


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server with only a TLS port and a self-signed certificate for localhost."""
    require_tool("redis-server", shutil.which("redis-server"), install="`make services` installs Debian's redis-server")
    require_tool("openssl", shutil.which("openssl"), install="`make services` installs Debian's openssl")
    tmp: Path = tmp_path_factory.mktemp("tls-redis")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    proc = Process(
        "redis-tls",
        [
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        {"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin"},
    )
    try:
        wait_until(lambda: "Ready to accept connections" in proc.log() or not proc.alive(), timeout=10)
        # A build without TLS refuses --tls-port (Debian's has it).
        require_tool(
            "redis-server",
            proc.alive(),
            missing=f"did not start with a TLS port ({proc.log().strip()[-300:]})",
            install="`make services` installs Debian's redis-server, built with TLS",
        )
        yield f"rediss://127.0.0.1:{port}/0"
    finally:
        proc.stop()


@pytest.mark.django_db
def test_readyz_reaches_a_self_signed_tls_redis_with_cert_reqs_none(client: Client, settings, tls_redis: str) -> None:
    settings.REDIS_URL = settings.CELERY_BROKER_URL = tls_redis
    settings.REDIS_SSL_CERT_REQS = "none"

    response = client.get("/readyz")

    assert (response.status_code, response.json()["checks"]) == (200, {"database": "ok", "broker": "ok"})


@pytest.mark.django_db
def test_readyz_says_the_broker_is_unavailable_when_required_refuses_a_self_signed_certificate(
    client: Client, settings, tls_redis: str
) -> None:
    settings.REDIS_URL = settings.CELERY_BROKER_URL = tls_redis
    settings.REDIS_SSL_CERT_REQS = "required"

    response = client.get("/readyz")

    assert response.status_code == 503
    broker = response.json()["checks"]["broker"]
    assert broker.startswith("unavailable: ")
    assert "certificate verify failed" in broker


@pytest.mark.e2e
def test_a_worker_and_web_on_a_tls_redis_deliver_an_echo_end_to_end(
    process_env: dict[str, str], processes: list[Process], sandbox, bot_factory, tls_redis: str
) -> None:
    env = {**process_env, "REDIS_URL": tls_redis, "REDIS_SSL_CERT_REQS": "none"}
    processes.append(start_worker(env, name="worker-tls"))
    web, url = start_web(env, name="web-tls")
    processes.append(web)
    bot = bot_factory()
    call_command("set_webhook", bot.name, "--url", url)

    assert sandbox.push_message(bot.token, chat_id=2024, text="over tls")["webhook_status"] == 200

    wait_until(lambda: OutboundMessage.objects.filter(bot=bot, state=State.SENT).exists(), timeout=30)
    assert sandbox.sent_texts(token=bot.token) == ["Echo: over tls"]
    # The drain (a Redis wake-up key) sent it: one attempt, no detour through the sweeper.
    assert OutboundMessage.objects.get(bot=bot).attempts == 1
    ready = httpx.get(f"{url}/readyz", timeout=10)
    assert (ready.status_code, ready.json()["checks"]) == (200, {"database": "ok", "broker": "ok"})
