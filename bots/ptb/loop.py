"""Where python-telegram-bot's coroutines run: the process's one event loop, in a thread of its
own (bots/aio.py's, shared with awaiting consumers and the Bot API client), never
`asyncio.run` per run (a loop per handling to set up and tear down).

The handling's Bot API calls need the database on the caller's connection (the journal, the
outbox, the run's transaction): the request class hands each to the caller's thread with
`in_caller`, and `run_coroutine` serves them there while it waits. Django's ORM thus never
runs on the loop's thread.

The one place a coroutine is run, on the loop the process shares with awaiting consumers
(bots/aio.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# The calling thread's queue of work handed back by the coroutine (set while it runs).
_caller: contextvars.ContextVar[queue.SimpleQueue[Any] | None] = contextvars.ContextVar(
    "dovecote_ptb_caller", default=None
)
_DONE = object()


def _loop() -> asyncio.AbstractEventLoop:
    """This process's loop, shared with awaiting consumers and the Bot API client (bots/aio.py;
    a forked child has its own)."""
    from bots import aio

    return aio.loop()


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the process's loop and wait for it, running here whatever it hands to
    this thread (`in_caller`). An exception of the coroutine, a BaseException too, is raised
    here; an interruption of this thread (a time limit) cancels the coroutine."""
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    loop = _loop()

    async def wrapped() -> T:
        _caller.set(inbox)
        return await coro

    future = asyncio.run_coroutine_threadsafe(wrapped(), loop)
    future.add_done_callback(lambda _: inbox.put(_DONE))
    try:
        while True:
            item = inbox.get()
            if item is _DONE:
                return future.result()
            fn, args, waiter = item
            try:
                value = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the coroutine, which decides
                loop.call_soon_threadsafe(_settle, waiter, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, waiter, value, None)
    except BaseException:
        future.cancel()
        raise


def _settle(waiter: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if waiter.done():
        return
    if exc is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(value)


async def in_caller(fn: Callable[..., T], *args: Any) -> T:
    """From the coroutine: run `fn(*args)` in the thread that runs it (`run_coroutine`), and
    wait for it. Outside `run_coroutine` (a plain script), in a worker thread of the loop."""
    inbox = _caller.get()
    loop = asyncio.get_running_loop()
    if inbox is None:
        return await loop.run_in_executor(None, fn, *args)
    waiter: asyncio.Future[T] = loop.create_future()
    inbox.put((fn, args, waiter))
    return await waiter
