"""A thin httpx wrapper over the Bot API sandbox's control API (``/sandbox/...``)."""

from __future__ import annotations

import time
from typing import Any

import httpx

__all__ = ["SandboxClient", "SandboxControlError"]

JSONDict = dict[str, Any]


class SandboxControlError(RuntimeError):
    """The sandbox rejected a control request (bad fault kind, malformed body, ...)."""


class SandboxClient:
    """Drive a running sandbox: inspect calls, inject faults, set limits, push updates.

    ``base_url`` is the sandbox root (``http://127.0.0.1:8081``); the PTB-style
    ``.../bot`` suffix is tolerated so the same setting can serve both.
    """

    def __init__(self, base_url: str, timeout: float = 30.0) -> None:
        base = base_url.rstrip("/")
        if base.endswith("/bot"):
            base = base[: -len("/bot")]
        self.base_url = base
        # One keep-alive connection for all control calls; webhook pushes can take a
        # while (the webhook handler runs synchronously), hence the generous timeout.
        self._http = httpx.Client(base_url=base, timeout=timeout)

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> JSONDict:
        response = self._http.request(method, f"/sandbox/{path}", **kwargs)
        data: JSONDict = response.json()
        if response.status_code >= 400:
            raise SandboxControlError(data.get("error") or f"HTTP {response.status_code}")
        return data

    @staticmethod
    def _filters(
        token: str | None,
        method: str | None,
        chat_id: int | None,
        delivered: bool | None,
    ) -> dict[str, str]:
        params: dict[str, str] = {}
        if token is not None:
            params["token"] = token
        if method is not None:
            params["method"] = method
        if chat_id is not None:
            params["chat_id"] = str(chat_id)
        if delivered is not None:
            params["delivered"] = "1" if delivered else "0"
        return params

    # ---------------------------------------------------------------- inspection
    def health(self) -> bool:
        return bool(self._request("GET", "health").get("ok"))

    def calls(
        self,
        token: str | None = None,
        method: str | None = None,
        chat_id: int | None = None,
        delivered: bool | None = None,
    ) -> list[JSONDict]:
        """Recorded Bot API calls, oldest first (``method`` matches case-insensitively)."""
        params = self._filters(token, method, chat_id, delivered)
        return list(self._request("GET", "calls", params=params)["calls"])

    def sent_texts(
        self,
        token: str | None = None,
        chat_id: int | None = None,
        delivered: bool | None = True,
    ) -> list[str]:
        """Texts of ``sendMessage`` calls (by default only those that took effect)."""
        calls = self.calls(token=token, method="sendMessage", chat_id=chat_id, delivered=delivered)
        return [str(c["params"].get("text", "")) for c in calls]

    def messages(
        self,
        token: str | None = None,
        chat_id: int | None = None,
        include_deleted: bool = False,
    ) -> list[JSONDict]:
        """Messages the bot created (one per delivered send/copy/forward), oldest first."""
        params = self._filters(token, None, chat_id, None)
        if include_deleted:
            params["include_deleted"] = "1"
        return list(self._request("GET", "messages", params=params)["messages"])

    def wait_for_calls(
        self,
        n: int,
        timeout: float = 10,
        *,
        token: str | None = None,
        method: str | None = None,
        chat_id: int | None = None,
        delivered: bool | None = None,
        interval: float = 0.02,
    ) -> list[JSONDict]:
        """Poll until at least ``n`` matching calls are recorded; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.calls(token=token, method=method, chat_id=chat_id, delivered=delivered)
            if len(found) >= n:
                return found
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"expected at least {n} calls matching token={token!r} method={method!r} "
                    f"chat_id={chat_id!r} delivered={delivered!r}; got {len(found)} "
                    f"after {timeout}s"
                )
            time.sleep(interval)

    # -------------------------------------------------------------------- control
    def reset(self, continue_after: JSONDict | None = None) -> None:
        """Forget calls, messages, faults, pending updates and webhooks; limits revert
        to the values the server was started with (off unless set on the CLI).
        `continue_after` ({token: {"update_id": N, "message_ids": {chat_id: N}}}) makes a bot's
        next update and message ids continue after those."""
        self._request("POST", "reset", json={"continue_after": continue_after} if continue_after else None)

    def fault(self, kind: str | int, **params: Any) -> JSONDict:
        """Inject a fault; returns it (``["id"]`` identifies it). See the server docs for
        ``token``/``method``/``chat_id`` matching and ``count``/``seconds`` expiry."""
        body = {"kind": str(kind), **{k: v for k, v in params.items() if v is not None}}
        return self._request("POST", "faults", json=body)

    def faults(self) -> list[JSONDict]:
        return list(self._request("GET", "faults")["faults"])

    def clear_faults(self, fault_id: int | None = None) -> None:
        self._request("DELETE", "faults" if fault_id is None else f"faults/{fault_id}")

    def limits(
        self,
        per_bot_per_second: int | None = None,
        per_private_chat_per_second: int | None = None,
        per_group_per_minute: int | None = None,
        arrival_jitter_ms: float = 0.0,
    ) -> JSONDict:
        """Set all three flood limits at once; ``None`` switches a limit off. With
        `arrival_jitter_ms`, each call reaches the counters up to that late."""
        body = {
            "per_bot_per_second": per_bot_per_second,
            "per_private_chat_per_second": per_private_chat_per_second,
            "per_group_per_minute": per_group_per_minute,
            "arrival_jitter_ms": arrival_jitter_ms,
        }
        return self._request("POST", "limits", json=body)

    # -------------------------------------------------------------------- updates
    def push_message(self, token: str, chat_id: int, text: str, **kw: Any) -> JSONDict:
        """Simulate a user writing ``text`` to the bot in ``chat_id``.

        Extra keywords: ``user_id``, ``update_id``, ``message_id``, ``chat_type``,
        ``first_name``, ``last_name``, ``username``, ``language_code``. Returns
        ``{"update": ..., "webhook_status": int|None}`` when a webhook is set (the
        update was POSTed to it) or ``{"update": ..., "queued": True}`` otherwise.
        """
        body = {"token": token, "chat_id": chat_id, "text": text, **kw}
        return self._request("POST", "updates", json=body)

    def push_callback(self, token: str, chat_id: int, data: str, **kw: Any) -> JSONDict:
        """Simulate a user pressing an inline button carrying ``data`` (``message_id``
        picks the message the button belongs to)."""
        body = {"token": token, "chat_id": chat_id, "callback_data": data, **kw}
        return self._request("POST", "updates", json=body)

    def push_update(self, token: str, update: JSONDict) -> JSONDict:
        """Push a raw Update (e.g. the same ``update_id`` twice to mimic redelivery)."""
        return self._request("POST", "updates", json={"token": token, "update": update})

    def pushed_updates(self, token: str | None = None) -> list[JSONDict]:
        """Every pushed update with its webhook outcome, oldest first."""
        params = {"token": token} if token is not None else {}
        return list(self._request("GET", "updates", params=params)["updates"])
