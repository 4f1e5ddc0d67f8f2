"""Guards on the python-telegram-bot surface bots/ptb stands on: an upgrade that changes any
of it fails here, loudly, before it fails in a worker."""

from __future__ import annotations

import asyncio
import inspect

import telegram
import telegram.ext as tx
from telegram.request import BaseRequest, RequestData

from bots.ptb.request import DovecoteRequest


def test_python_telegram_bot_is_the_pinned_major_version() -> None:
    assert telegram.__version_info__[:1] == (22,)


def test_base_request_has_the_abstract_methods_the_request_class_implements() -> None:
    assert BaseRequest.__abstractmethods__ == {"do_request", "initialize", "read_timeout", "shutdown"}
    assert not DovecoteRequest.__abstractmethods__
    params = list(inspect.signature(BaseRequest.do_request).parameters)
    assert params[:4] == ["self", "url", "method", "request_data"]


def test_request_data_gives_parameters_and_says_whether_it_has_files() -> None:
    assert isinstance(inspect.getattr_static(RequestData, "parameters"), property)
    assert "contains_files" in RequestData.__slots__


def test_base_persistence_has_the_abstract_methods_dovecote_s_persistence_implements() -> None:
    assert tx.BasePersistence.__abstractmethods__ == {
        "drop_chat_data",
        "drop_user_data",
        "flush",
        "get_bot_data",
        "get_callback_data",
        "get_chat_data",
        "get_conversations",
        "get_user_data",
        "refresh_bot_data",
        "refresh_chat_data",
        "refresh_user_data",
        "update_bot_data",
        "update_callback_data",
        "update_chat_data",
        "update_conversation",
        "update_user_data",
    }


def test_the_builder_takes_an_application_class_a_request_and_no_job_queue() -> None:
    builder = tx.ApplicationBuilder()
    for name in ("application_class", "request", "get_updates_request", "job_queue", "persistence", "token"):
        assert callable(getattr(builder, name)), name
    assert isinstance(inspect.getattr_static(tx.Application, "builder"), staticmethod)
    assert isinstance(inspect.getattr_static(tx.Application, "job_queue"), property)
    for name in ("run_polling", "run_webhook", "process_update", "initialize", "add_error_handler"):
        assert callable(getattr(tx.Application, name)), name


class _Stop(BaseException):
    pass


class _Raising(DovecoteRequest):
    async def do_request(self, *args, **kwargs):  # type: ignore[override]
        raise _Stop


def test_a_base_exception_from_the_request_escapes_the_handler_and_process_update() -> None:
    """The journal stops a run (suspension, a handler not deterministic) by raising a
    BaseException from the request: python-telegram-bot must let it through its request
    wrapper, the handler's error handling and process_update, which catch `Exception`."""
    errors: list[BaseException] = []

    async def echo(update: telegram.Update, context: tx.ContextTypes.DEFAULT_TYPE) -> None:
        await update.message.reply_text(update.message.text)

    async def noted(update: object, context: tx.CallbackContext) -> None:
        errors.append(context.error)

    async def scenario() -> None:
        app = tx.ApplicationBuilder().token("1:x").request(_Raising("x")).get_updates_request(_Raising("x")).build()
        app.add_handler(tx.MessageHandler(tx.filters.TEXT, echo))
        app.add_error_handler(noted)
        app.bot._bot_user = telegram.User(1, "bot", True, username="bot")  # no getMe
        app._initialized = True
        update = telegram.Update.de_json(
            {
                "update_id": 1,
                "message": {"message_id": 1, "date": 0, "chat": {"id": 5, "type": "private"}, "text": "hi"},
            },
            app.bot,
        )
        await app.process_update(update)

    raised = None
    try:
        asyncio.run(scenario())
    except _Stop as exc:
        raised = exc
    assert isinstance(raised, _Stop)
    assert errors == []


def test_the_conversation_handler_internals_persistence_fills_are_there() -> None:
    """A ConversationHandler is made persistent after the bot built it, and its state for
    the update's key is set before each run (bots/ptb/persistence.py): private names, so an
    upgrade may move them."""
    for name in ("_persistent", "_name", "_conversations", "_child_conversations"):
        assert name in tx.ConversationHandler.__slots__, name
    assert callable(tx.ConversationHandler._get_key)
    from telegram.ext._utils.trackingdict import TrackingDict

    tracked = TrackingDict()
    tracked.update_no_track({("a",): 1})
    assert tracked.data == {("a",): 1}
    assert tracked.pop_accessed_write_items() == []


def test_callback_context_refreshes_the_update_s_data_from_the_persistence() -> None:
    source = inspect.getsource(tx.CallbackContext.refresh_data)
    for hook in ("refresh_bot_data", "refresh_chat_data", "refresh_user_data"):
        assert hook in source, hook
    assert inspect.iscoroutinefunction(tx.Application.update_persistence)
