"""Responders write auto-replies. `echo` is for the demo and tests; `openai` calls any
OpenAI-compatible chat-completions endpoint."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bots.models import Bot

Responder = Callable[[Bot, Sequence[str]], str]


def echo(bot: Bot, texts: Sequence[str]) -> str:
    """`Echo: ` followed by the gathered texts, one per line (CONTRACT.md)."""
    return "Echo: " + "\n".join(texts)


_RESPONDERS: dict[str, Responder] = {"echo": echo}


def register(name: str, responder: Responder) -> None:
    _RESPONDERS[name] = responder


def get_responder(name: str) -> Responder | None:
    return _RESPONDERS.get(name)
