"""Telegram Bot API sandbox: a local fake of api.telegram.org for tests, demo and benchmarks.

The sandbox speaks enough of the Bot API for python-telegram-bot to work against it
(``telegram.Bot(token, base_url=f"{server.base_url}/bot")``), records every call,
keeps the messages it "delivered", and injects faults and flood limits on command
through a small JSON control API under ``/sandbox/``.

``state`` holds what it recorded, ``methods`` the Bot API methods it answers, ``http``
the request parsing and routes, ``server`` the listener and webhook deliveries, ``cli``
the command line; ``client`` drives a running sandbox from tests.
"""

from bots.sandbox.client import SandboxClient, SandboxControlError
from bots.sandbox.server import SandboxServer
from bots.sandbox.state import SandboxState

__all__ = ["SandboxClient", "SandboxControlError", "SandboxServer", "SandboxState"]
