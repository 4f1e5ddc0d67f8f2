"""Command line: ``python -m bots.sandbox.cli`` (and ``manage.py telegram_sandbox``,
which shares its flags) runs the sandbox in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from bots.sandbox.server import SandboxServer

__all__ = ["add_arguments", "main", "serve_until_signalled", "server_from_options"]


def serve_until_signalled(server: SandboxServer, announce: Callable[[str], None]) -> None:
    """Run ``server`` in the foreground; SIGINT/SIGTERM stop it cleanly."""

    def _on_signal(signum: int, frame: object) -> None:
        # shutdown() waits for serve_forever() to return, and serve_forever() runs in
        # this (main) thread, so the stop has to happen in a helper thread.
        threading.Thread(target=server.stop, name="sandbox-stop", daemon=True).start()

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.bind()
        announce(f"Bot API sandbox listening on {server.base_url}")
        server.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """CLI flags shared by ``manage.py telegram_sandbox`` and ``python -m``."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--webhook-base", default=None, help="deliver webhooks under this base URL")
    parser.add_argument("--bot-rate", type=int, default=None, help="messages per second per bot")
    parser.add_argument(
        "--private-chat-rate",
        type=int,
        default=None,
        help="messages per second per private chat",
    )
    parser.add_argument(
        "--group-rate-per-minute",
        type=int,
        default=None,
        help="messages per minute per group",
    )
    parser.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="each call reaches the flood counters up to this many ms late, as over a network",
    )


def server_from_options(options: dict[str, Any]) -> SandboxServer:
    return SandboxServer(
        host=options["host"],
        port=options["port"],
        webhook_base=options.get("webhook_base"),
        per_bot_per_second=options.get("bot_rate"),
        per_private_chat_per_second=options.get("private_chat_rate"),
        per_group_per_minute=options.get("group_rate_per_minute"),
        arrival_jitter_ms=options.get("jitter_ms") or 0.0,
    )


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Telegram Bot API sandbox")
    add_arguments(parser)
    options = vars(parser.parse_args(list(argv) if argv is not None else None))

    def announce(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    serve_until_signalled(server_from_options(options), announce)


if __name__ == "__main__":
    main(sys.argv[1:])
