"""A fake OpenAI-compatible chat-completions endpoint for tests and benchmarks: it answers
`POST .../chat/completions` after a set delay, and counts the calls in flight (now and at
peak) so that a test can see how many model calls a worker holds at once.

One asyncio server in a daemon thread, so that hundreds of calls in flight cost it nothing.
Set `delay`, `mode` and `status` on the object or with `POST /control`; `GET /stats` reads
the counts. Modes: "answer" (after `delay`), "hang" (never answers), "status" (answers
`status` at once). A last user message starting with "hang" is never answered, one starting
with "slow" after three times the delay.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

__all__ = ["FakeModel"]


class FakeModel:
    def __init__(self, *, delay: float = 3.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.delay = delay
        self.mode = "answer"
        self.status = 429
        self.host, self.port = host, port
        self.in_flight = 0
        self.peak = 0
        self.calls = 0
        self.answered = 0
        # Calls in flight now and at peak per caller (its User-Agent: a Dovecote worker names
        # its process there).
        self.by_caller: dict[str, int] = {}
        self.peak_by_caller: dict[str, int] = {}
        self.call_times: list[float] = []
        self.requests: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()

    @property
    def base_url(self) -> str:
        """What OPENAI_BASE_URL is set to."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> FakeModel:
        threading.Thread(target=self._serve, name="fake-model", daemon=True).start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake model did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)

    def stats(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "peak": self.peak,
            "calls": self.calls,
            "answered": self.answered,
            "peak_by_caller": dict(self.peak_by_caller),
        }

    def reset(self) -> None:
        self.peak, self.calls, self.answered = self.in_flight, 0, 0
        self.peak_by_caller = dict(self.by_caller)
        self.call_times.clear()
        self.requests.clear()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def start() -> None:
            self._server = await asyncio.start_server(self._connection, self.host, self.port, backlog=2048)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        loop.run_until_complete(start())
        loop.run_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
                }
                length = int(headers.get("content-length") or 0)
                raw = await reader.readexactly(length) if length else b""
                status, answer = await self._answer(method, path, headers, raw)
                data = json.dumps(answer).encode()
                reply_head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                reply_head += "\r\n"
                writer.write(reply_head.encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        body = json.loads(raw) if raw else {}
        if path.endswith("/stats"):
            return 200, self.stats()
        if path.endswith("/control"):
            for name in ("delay", "mode", "status"):
                if name in body:
                    setattr(self, name, body[name])
            if body.get("reset"):
                self.reset()
            return 200, self.stats()
        if not path.endswith("/chat/completions") or method != "POST":
            return 404, {"error": {"message": "not found"}}
        self.calls += 1
        last = next((m["content"] for m in reversed(body.get("messages") or []) if m.get("role") == "user"), "")
        self.call_times.append(time.time())
        self.requests.append({"path": path, "headers": headers, "body": body, "text": last, "at": time.time()})
        caller = headers.get("user-agent", "")
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.by_caller[caller] = self.by_caller.get(caller, 0) + 1
        self.peak_by_caller[caller] = max(self.peak_by_caller.get(caller, 0), self.by_caller[caller])
        try:
            if self.mode == "status":
                return int(self.status), {"error": {"message": f"fake status {self.status}"}}
            if self.mode == "hang" or last.startswith("hang"):
                await asyncio.sleep(3600)
            await asyncio.sleep(float(self.delay) * (3 if last.startswith("slow") else 1))
        finally:
            self.in_flight -= 1
            self.by_caller[caller] -= 1
        self.answered += 1
        return 200, {
            "id": f"chatcmpl-{self.calls}",
            "object": "chat.completion",
            "model": body.get("model", ""),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": f"Model: {last}"}, "finish_reason": "stop"}
            ],
        }


def main() -> None:
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="a fake OpenAI-compatible endpoint that sleeps a set time")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--delay", type=float, default=3.0)
    options = parser.parse_args()
    model = FakeModel(delay=options.delay, port=options.port).start()
    sys.stdout.write(f"fake model at {model.base_url} (delay {model.delay}s)\n")
    sys.stdout.flush()
    threading.Event().wait()


if __name__ == "__main__":
    main()
