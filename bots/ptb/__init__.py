"""Bring your handlers: an existing python-telegram-bot bot run as a durable Dovecote consumer.

In an app's consumers.py::

    from bots.ptb import ptb_consumer
    ptb_consumer("shop", bot="shop", main="shopbot.main:main")

and in the bot, where it builds its Application, ``from bots.ptb import Application`` (this
module also gives every other name of ``telegram.ext``, so the bot's one import line of it can
simply point here). Or `setup="shopbot.handlers:add_handlers"`, a function that adds the
handlers to an application it is given, and nothing in the bot changes.

See docs/PTB.md: what each kind of call does, the journal, persistence, the limits.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["Application", "ptb_consumer"]


def ptb_consumer(
    name: str,
    *,
    bot: str,
    main: str | None = None,
    setup: str | None = None,
    serial: str | None = None,
    update_types: list[str] | None = None,
    max_attempts: int = 5,
    max_age: timedelta = timedelta(hours=24),
    timeout: float | None = None,
) -> None:
    """Register consumer `name`: bot `bot`'s updates handled by the application that `main`
    (the bot's own main(), which builds it) or `setup` (given an application, adds the
    handlers) makes. The application is built once per worker process, on its first update.

    `serial="chat"`: a chat's runs go one at a time, in the order of its updates (a run waits,
    without holding a worker, until the chat's earlier runs are finished): what a
    conversation needs."""
    from bots.ptb.runner import PtbApp, consumer_func
    from bots.registry import consumer

    if (main is None) == (setup is None):
        raise ValueError("give `main` (the bot's main()) or `setup` (a function adding handlers), not both")
    if serial not in (None, "chat"):
        raise ValueError('serial is None or "chat"')
    app = PtbApp(consumer=name, bot=bot, main=main, setup=setup, serial=serial)
    consumer(
        name,
        update_types=update_types,
        max_attempts=max_attempts,
        max_age=max_age,
        timeout=timeout,
        bot=bot,
    )(consumer_func(app))


def __getattr__(name: str) -> Any:
    # `Application` is Dovecote's; every other name is python-telegram-bot's telegram.ext.
    if name == "Application":
        from bots.ptb.app import Application

        return Application
    import telegram.ext

    try:
        return getattr(telegram.ext, name)
    except AttributeError:
        raise AttributeError(f"module 'bots.ptb' has no attribute {name!r}") from None
