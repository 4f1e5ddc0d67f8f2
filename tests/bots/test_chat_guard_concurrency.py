"""Routers on several workers write the chat guards of their batches at once: however their
batches share and order the chats, none of them deadlocks on the guards' rows."""

from __future__ import annotations

import random

import pytest
from django.db import transaction

from bots import transitions
from bots.models import ChatState
from tests.support import in_threads

pytestmark = pytest.mark.django_db(transaction=True)

CHATS = list(range(9001, 9021))


def test_routers_moving_the_guards_of_shared_chats_in_their_own_orders_never_deadlock(bot) -> None:
    # Seen at 100 updates/s over 1,500 chats: PostgreSQL broke such a deadlock after 1 s, and
    # the router's whole batch was rolled back and waited for the next router.
    def router(i: int) -> list[str]:
        rng = random.Random(i)  # a seeded order per router
        errors = []
        for round_ in range(1, 9):
            order = CHATS[:]
            rng.shuffle(order)
            try:
                with transaction.atomic():
                    transitions.note_chats_answered(bot_id=bot.pk, answered=[(c, round_ * 10 + i) for c in order])
            except Exception as exc:  # what a deadlock raises: kept to be shown
                errors.append(f"{type(exc).__name__}: {exc}")
        return errors

    assert in_threads(3, router) == [[], [], []]
    # Each chat's guard holds the newest message any router answered in it.
    assert set(ChatState.objects.filter(bot=bot).values_list("chat_id", "last_answered_message_id")) == {
        (c, 82) for c in CHATS
    }
