"""The optional Sentry hook: SENTRY_DSN set turns it on (Django and Celery integrations, events
masked as the logs are), unset leaves it off. A real Sentry-compatible endpoint: a local HTTP
server that records the envelopes it receives."""

from __future__ import annotations

import gzip
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support import ROOT, VENV_BIN, base_env

TOKEN = "123456789:AAHfakeTokenFakeTokenFakeToken1234"

SCRIPT = f"""
import django, json
django.setup()
import sentry_sdk
from django.conf import settings
client = sentry_sdk.get_client()
try:
    raise RuntimeError("sending with {TOKEN} failed")
except RuntimeError as exc:
    sentry_sdk.capture_exception(exc)
sentry_sdk.flush(timeout=10)
print(json.dumps({{"enabled": settings.SENTRY_ENABLED, "active": client.is_active(),
                   "integrations": sorted(getattr(client, "integrations", {{}}))}}))
"""


class Envelopes(ThreadingHTTPServer):
    received: list[bytes]


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.received.append(body)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sentry() -> Iterator[Envelopes]:
    server = Envelopes(("127.0.0.1", 0), Handler)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run(env: dict[str, str]) -> dict:
    result = subprocess.run(
        [str(VENV_BIN / "python"), "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_sentry_dsn_set_reports_errors_masked_with_the_django_and_celery_integrations(sentry: Envelopes) -> None:
    dsn = f"http://publickey@127.0.0.1:{sentry.server_address[1]}/1"
    seen = run(base_env(SENTRY_DSN=dsn, DJANGO_SETTINGS_MODULE="project.test_settings"))

    assert seen["enabled"] is True
    assert seen["active"] is True
    assert {"django", "celery"} <= set(seen["integrations"])
    events = b"".join(sentry.received)
    assert b"RuntimeError" in events
    assert b"sending with <token> failed" in events
    assert TOKEN.encode() not in events


def test_without_sentry_dsn_nothing_is_set_up_or_sent(sentry: Envelopes) -> None:
    env = base_env(DJANGO_SETTINGS_MODULE="project.test_settings")
    env.pop("SENTRY_DSN", None)
    seen = run(env)

    assert seen == {"enabled": False, "active": False, "integrations": []}
    assert sentry.received == []
