"""python-telegram-bot's persistence in PostgreSQL (HandlerData rows), per run.

What a handling may read is loaded before it starts, for the update's user and chat only
(python-telegram-bot's `refresh_*_data` hooks fill the application's dicts from it); what it
changed is collected by `update_*` calls and written in the transaction that marks the run
done (bots/ptb/runner.py), so a crashed run resumes in the state it started from.
ConversationHandlers are made persistent when the application is loaded; data must be JSON
(a conversation's key is stored as its JSON list). More: docs/PTB.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import telegram
import telegram.ext as tx
from django.db.models import Q

from bots.models import InboundUpdate
from bots.ptb.models import HandlerData

Kind = HandlerData.Kind
BOT_KEY = "bot"


@dataclass
class Snapshot:
    """One run's view of the consumer's data: what was loaded, and the writes it collected."""

    bot_id: int
    consumer: str
    allowed: frozenset[tuple[str, str]] = frozenset()
    loaded: dict[tuple[str, str], Any] = field(default_factory=dict)
    writes: dict[tuple[str, str], str | None] = field(default_factory=dict)  # JSON; None deletes the row

    @classmethod
    def load(cls, *, update: InboundUpdate, consumer: str, conversations: list[str]) -> Snapshot:
        """The rows a handling of `update` may read, in one query: the bot's data, the user's,
        the chat's, and the states of the given conversation keys."""
        keys = [(Kind.BOT, BOT_KEY), *((Kind.CONVERSATION, key) for key in conversations)]
        if update.user_id is not None:
            keys.append((Kind.USER, str(update.user_id)))
        if update.chat_id is not None:
            keys.append((Kind.CHAT, str(update.chat_id)))
        wanted = Q()
        for kind, key in keys:
            wanted |= Q(kind=kind, key=key)
        rows = HandlerData.objects.filter(wanted, bot_id=update.bot_id, consumer=consumer).values_list(
            "kind", "key", "data"
        )
        return cls(
            bot_id=update.bot_id,
            consumer=consumer,
            allowed=frozenset(keys),
            loaded={(k, key): json.loads(data) for k, key, data in rows},
        )

    def get(self, kind: str, key: str) -> Any:
        return self.loaded.get((kind, key))

    def write(self, kind: str, key: str, data: Any) -> None:
        """Collect a change. Only this update's user, chat, bot and conversations: what the
        application still holds of another update's run (one that was suspended or failed,
        and so committed nothing) is never written from here."""
        if (kind, key) not in self.allowed:
            return
        if self.loaded.get((kind, key)) != data or (kind, key) in self.writes:
            # Encoded now: a value JSON cannot hold fails the run here, not at its commit.
            self.writes[(kind, key)] = None if data is None else json.dumps(data)

    def save(self) -> None:
        """Write the collected changes (in the caller's transaction: the run's completion)."""
        for (kind, key), data in self.writes.items():
            rows = HandlerData.objects.filter(bot_id=self.bot_id, consumer=self.consumer, kind=kind, key=key)
            if data is None:
                rows.delete()
            elif not rows.update(data=data):
                HandlerData.objects.create(bot_id=self.bot_id, consumer=self.consumer, kind=kind, key=key, data=data)


def conversation_key(name: str, key: Any) -> str:
    return f"{name}:{json.dumps(list(key) if isinstance(key, tuple) else key)}"


class DovecotePersistence(tx.BasePersistence):
    """BasePersistence over the current run's Snapshot (bots/ptb/calls.py's Handling)."""

    def __init__(self) -> None:
        super().__init__(store_data=tx.PersistenceInput(callback_data=False), update_interval=3600)

    @staticmethod
    def _snapshot() -> Snapshot | None:
        from bots.ptb import calls

        handling = calls.current.get()
        return handling.snapshot if handling is not None else None

    # Nothing is loaded at the application's start: each run loads its own.
    async def get_user_data(self) -> dict[int, Any]:
        return {}

    async def get_chat_data(self) -> dict[int, Any]:
        return {}

    async def get_bot_data(self) -> Any:
        return {}

    async def get_callback_data(self) -> None:
        return None

    async def get_conversations(self, name: str) -> dict[Any, object]:
        return {}

    async def refresh_user_data(self, user_id: int, user_data: Any) -> None:
        _replace(user_data, self._loaded(Kind.USER, str(user_id)))

    async def refresh_chat_data(self, chat_id: int, chat_data: Any) -> None:
        _replace(chat_data, self._loaded(Kind.CHAT, str(chat_id)))

    async def refresh_bot_data(self, bot_data: Any) -> None:
        _replace(bot_data, self._loaded(Kind.BOT, BOT_KEY))

    def _loaded(self, kind: str, key: str) -> Any:
        snapshot = self._snapshot()
        return snapshot.get(kind, key) if snapshot is not None else None

    def _write(self, kind: str, key: str, data: Any) -> None:
        snapshot = self._snapshot()
        if snapshot is not None:
            snapshot.write(kind, key, data)

    async def update_user_data(self, user_id: int, data: Any) -> None:
        self._write(Kind.USER, str(user_id), dict(data))

    async def update_chat_data(self, chat_id: int, data: Any) -> None:
        self._write(Kind.CHAT, str(chat_id), dict(data))

    async def update_bot_data(self, data: Any) -> None:
        self._write(Kind.BOT, BOT_KEY, dict(data))

    async def update_conversation(self, name: str, key: Any, new_state: object | None) -> None:
        self._write(Kind.CONVERSATION, conversation_key(name, key), new_state)

    async def drop_user_data(self, user_id: int) -> None:
        self._write(Kind.USER, str(user_id), None)

    async def drop_chat_data(self, chat_id: int) -> None:
        self._write(Kind.CHAT, str(chat_id), None)

    async def update_callback_data(self, data: Any) -> None:
        return None

    async def flush(self) -> None:
        return None


def _replace(target: Any, data: Any) -> None:
    target.clear()
    if isinstance(data, dict):
        target.update(data)


def conversation_handlers(application: tx.Application) -> Iterator[tx.ConversationHandler]:
    """Every ConversationHandler of the application, nested ones too."""
    stack = [h for group in application.handlers.values() for h in group if isinstance(h, tx.ConversationHandler)]
    while stack:
        handler = stack.pop()
        yield handler
        stack.extend(handler._child_conversations)


def make_conversations_persistent(application: tx.Application) -> None:
    """Give each ConversationHandler persistence (before the application is initialised), named
    after its place among the handlers unless it has a name: the bot's code is not changed."""
    for n, handler in enumerate(conversation_handlers(application)):
        if not handler.persistent:
            handler._persistent = True
            handler._name = handler.name or f"conversation-{n}"


def conversation_keys(application: tx.Application, update: telegram.Update) -> dict[str, tuple[Any, Any]]:
    """{stored key: (handler, its key)} of each conversation this update may be part of."""
    found = {}
    for handler in conversation_handlers(application):
        try:
            key = handler._get_key(update)
        except RuntimeError:
            continue  # the update has no chat or user for this handler's key
        found[conversation_key(str(handler.name), key)] = (handler, key)
    return found


def load_conversations(keys: dict[str, tuple[Any, Any]], snapshot: Snapshot) -> None:
    """Each conversation's state for this update as stored (or none), untracked: only what
    the handling changes is written back."""
    for stored, (handler, key) in keys.items():
        state = snapshot.get(Kind.CONVERSATION, stored)
        if state is None:
            handler._conversations.data.pop(key, None)
        else:
            handler._conversations.update_no_track({key: state})
