"""The bot's own python-telegram-bot `Application`, built by its own `main()` (or a setup
function) and handed to Dovecote instead of polling.

`bots.ptb.Application` is python-telegram-bot's `Application` with one difference: while
Dovecote loads the bot (`load_application`), its builder fits the request class that answers
the handlers' calls (bots/ptb/request.py), and `run_polling`/`run_webhook` hand the built
application over instead of running. Run directly (``python shopbot/main.py``) it polls as
plain python-telegram-bot.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import telegram.ext as tx
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from bots.ptb.loop import run_coroutine
from bots.ptb.persistence import make_conversations_persistent

# The Dovecote bot whose application is being loaded (None: plain python-telegram-bot).
_loading: ContextVar[str | None] = ContextVar("dovecote_ptb_loading", default=None)
_built: list[tx.Application] = []


class Built(BaseException):
    def __init__(self, application: tx.Application) -> None:
        super().__init__("the application is built")
        self.application = application


class JobQueueUnavailable(BaseException):
    pass


JOB_QUEUE_UNAVAILABLE = (
    "the job queue is not available to handlers run by Dovecote: its jobs would live in one "
    "worker's memory and die with it (a durable job queue is not part of Dovecote yet)"
)


class NoJobQueue:
    """Stands in for the job queue: any use of it stops the run (JobQueueUnavailable)."""

    def __bool__(self) -> bool:
        return False  # Application.start/stop: nothing to start or stop

    def __getattr__(self, name: str) -> Any:
        raise JobQueueUnavailable(JOB_QUEUE_UNAVAILABLE)


class Application(tx.Application):
    """python-telegram-bot's Application; see the module's docstring."""

    def __init__(self, **kwargs: Any) -> None:
        self.dovecote_bot = _loading.get()
        super().__init__(**kwargs)
        if self.dovecote_bot is not None:
            # python-telegram-bot reads the job queue from this attribute (CallbackContext);
            # its handlers get one that says why there is none, instead of None.
            self._job_queue = NoJobQueue()
            _built.append(self)

    @staticmethod
    def builder() -> tx.ApplicationBuilder:  # type: ignore[override]
        builder = tx.ApplicationBuilder().application_class(Application)
        bot_name = _loading.get()
        if bot_name is not None:
            from bots.ptb.persistence import DovecotePersistence
            from bots.ptb.request import DovecoteRequest

            builder = builder.request(DovecoteRequest(bot_name)).get_updates_request(DovecoteRequest(bot_name))
            builder = builder.job_queue(None).persistence(DovecotePersistence())  # type: ignore[assignment]
        return builder

    def run_polling(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "dovecote_bot", None) is not None:
            raise Built(self)
        return super().run_polling(*args, **kwargs)

    def run_webhook(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "dovecote_bot", None) is not None:
            raise Built(self)
        return super().run_webhook(*args, **kwargs)



def _import(path: str) -> Callable[..., Any]:
    """"package.module:function" (or dotted) to the function."""
    return import_string(path.replace(":", "."))


def load_application(*, bot: str, main: str | None = None, setup: str | None = None) -> tx.Application:
    """Build the bot's application as its own code does, with Dovecote's request class, and
    initialise it (its getMe is a live call)."""
    token = _loading.set(bot)
    del _built[:]
    try:
        if main is not None:
            try:
                _import(main)()
            except Built as built:
                application = built.application
            else:
                if not _built:
                    raise ImproperlyConfigured(
                        f"{main} built no Application through bots.ptb's Application.builder(): "
                        "change its import to `from bots.ptb import Application`"
                    )
                application = _built[-1]
        elif setup is not None:
            application = Application.builder().token("dovecote").build()
            _import(setup)(application)
        else:
            raise ImproperlyConfigured("a python-telegram-bot consumer needs `main` or `setup`")
    finally:
        _loading.reset(token)
        del _built[:]
    make_conversations_persistent(application)
    run_coroutine(application.initialize())
    return application
