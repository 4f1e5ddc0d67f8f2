"""The outbox's fixed reads (outbox/selectors.py) give the rows the ORM gives."""

from __future__ import annotations

import pytest
from django.forms.models import model_to_dict

from bots.models import Bot
from outbox import circuits, selectors
from outbox.models import Circuit, CircuitState

pytestmark = pytest.mark.django_db


def test_a_drain_reads_its_bot_and_its_circuit_as_the_orm_reads_them(bot_factory) -> None:
    paused = bot_factory(rate_limit=7)
    circuits.pause(circuits.bot_scope(paused.pk), reason="operator pause")
    plain = bot_factory()
    Circuit.objects.create(scope=f"bot:{plain.pk}0", state=CircuitState.OPEN)  # another bot's scope

    bot, circuit = selectors.bot_and_circuit(paused.pk)
    assert model_to_dict(bot) == model_to_dict(Bot.objects.get(pk=paused.pk))
    assert (bot.rate_limit, bot._state.adding) == (7, False)
    stored = Circuit.objects.get(scope=circuits.bot_scope(paused.pk))
    assert model_to_dict(circuit) == model_to_dict(stored)
    assert (circuit.pk, circuit.state, circuit.manual, circuit.updated_at) == (
        stored.pk,
        CircuitState.OPEN,
        True,
        stored.updated_at,
    )
    assert model_to_dict(selectors.bot_circuit(paused.pk)) == model_to_dict(stored)

    bot, circuit = selectors.bot_and_circuit(plain.pk)
    assert (bot.pk, circuit) == (plain.pk, None)
    assert selectors.bot_circuit(plain.pk) is None

    assert selectors.bot_and_circuit(plain.pk + paused.pk + 1000) == (None, None)
