"""Telegram Bot API sandbox: a local fake of api.telegram.org for tests, demo and benchmarks."""

from bots.sandbox.client import SandboxClient, SandboxControlError
from bots.sandbox.server import SandboxServer, SandboxState

__all__ = ["SandboxClient", "SandboxControlError", "SandboxServer", "SandboxState"]
