"""``SandboxServer``: the sandbox's listener (start, stop, come back on the same port)
and its webhook deliveries."""

from __future__ import annotations

import runpy
import threading
from urllib.parse import urlsplit

import httpx

from bots.sandbox.http import SandboxHTTPServer, json_bytes
from bots.sandbox.state import JSONDict, Limits, SandboxState

__all__ = ["SandboxServer"]


class SandboxServer:
    """The Bot API sandbox HTTP server.

    ``webhook_base`` rewrites where webhooks are delivered: a bot registering
    ``https://bot.example.com/tg/hook`` gets its updates POSTed to
    ``<webhook_base>/tg/hook`` (relative webhook URLs are joined to it as well), so
    production-looking URLs reach a local Django runserver.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8081,
        webhook_base: str | None = None,
        *,
        per_bot_per_second: int | None = None,
        per_private_chat_per_second: int | None = None,
        per_group_per_minute: int | None = None,
        arrival_jitter_ms: float = 0.0,
    ) -> None:
        self.host = host
        self.port = port
        self.webhook_base = webhook_base.rstrip("/") if webhook_base else None
        self.state = SandboxState(
            Limits(per_bot_per_second, per_private_chat_per_second, per_group_per_minute, arrival_jitter_ms)
        )
        self._httpd: SandboxHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._webhook_client: httpx.Client | None = None
        self._client_lock = threading.Lock()

    @property
    def base_url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:8081``; PTB wants ``f"{base_url}/bot"``."""
        # A wildcard bind is not a connectable address; point clients at loopback.
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host  # noqa: S104
        return f"http://{host}:{self.port}"

    @property
    def bot_api_url(self) -> str:
        return f"{self.base_url}/bot"

    def bind(self) -> None:
        """Create the listening socket (idempotent); afterwards ``port`` is the real port."""
        if self._httpd is None:
            self._httpd = SandboxHTTPServer((self.host, self.port), self.state, self.push_update)
            self.port = self._httpd.server_address[1]

    def start(self) -> SandboxServer:
        """Serve in a background daemon thread; returns once the socket is listening.

        After `stop()` it listens again on the same port with the same state (recorded calls,
        messages, faults), so a test can refuse connections for a while and then come back."""
        self.state.stopping = False
        self.bind()
        assert self._httpd is not None
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"bot-api-sandbox:{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until ``stop()`` is called from another thread."""
        self.bind()
        assert self._httpd is not None
        try:
            self._httpd.serve_forever(poll_interval=0.1)
        finally:
            self._close()

    def stop(self) -> None:
        """Stop listening and cut open connections (requests in flight get no answer);
        the state is kept for a later `start()`."""
        httpd = self._httpd
        if httpd is None:
            return
        self.state.stop()  # wake long-polling getUpdates so their threads finish
        httpd.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._close()

    def _close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.server_close()
            httpd.close_connections()
        with self._client_lock:
            client, self._webhook_client = self._webhook_client, None
        if client is not None:
            client.close()

    def __enter__(self) -> SandboxServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ webhooks
    def webhook_target(self, url: str) -> str:
        if self.webhook_base is None:
            return url
        parts = urlsplit(url)
        path = parts.path if parts.scheme else url.split("?", 1)[0]
        target = self.webhook_base + (path if path.startswith("/") else "/" + path)
        return f"{target}?{parts.query}" if parts.query else target

    def push_update(self, spec: JSONDict) -> JSONDict:
        token, update, webhook = self.state.build_update(spec)
        if webhook is None:
            return {"ok": True, "update": update, "queued": True}
        headers = {"Content-Type": "application/json"}
        if webhook.secret_token:
            headers["X-Telegram-Bot-Api-Secret-Token"] = webhook.secret_token
        status: int | None = None
        error: str | None = None
        try:
            # Delivered outside the state lock: the webhook handler may call back into us.
            response = self._client().post(
                self.webhook_target(webhook.url),
                content=json_bytes(update),
                headers=headers,
            )
            status = response.status_code
            if not 200 <= status < 300:
                error = f"Wrong response from the webhook: {status} {response.reason_phrase}"
        except httpx.HTTPError as exc:
            error = f"Connection failed: {exc.__class__.__name__}: {exc}"
        self.state.note_webhook_result(token, update, status, error)
        result: JSONDict = {"ok": True, "update": update, "webhook_status": status}
        if error is not None:
            result["webhook_error"] = error
        return result

    def _client(self) -> httpx.Client:
        with self._client_lock:
            if self._webhook_client is None:
                self._webhook_client = httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0))
            return self._webhook_client


if __name__ == "__main__":
    # ``python -m bots.sandbox.server`` predates bots/sandbox/cli.py and still works; the
    # command line sits above this module, so it is run by name rather than imported.
    runpy.run_module("bots.sandbox.cli", run_name="__main__", alter_sys=True)
