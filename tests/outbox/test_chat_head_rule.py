"""The chat-head rule, checked against a model: only the head of a chat's ordered queue may
go. Hypothesis draws small outbox tables (bots, chats, states, send_at, due times, ordered
and broadcast flags, the bots' circuits) into PostgreSQL; a few lines of Python say which
messages the rule lets go, and the SQL must agree:

- `claim_batch` claims exactly the bot's due, waiting, non-broadcast messages that no
  earlier open ordered message of their chat holds up - none at all while the bot's
  circuit is not closed;
- `earlier_open_message_exists(message)` says "blocked" exactly when the model does.

"Open" is `retry`, `sending`, or `pending` and due by its sender's schedule (no `send_at`,
or `send_at` passed); a message scheduled for later, and `sent`, `failed`, `unknown` and
`cancelled` ones, hold nobody up; unordered messages never wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import selectors, transitions
from outbox.models import Circuit, CircuitState, OutboundMessage, State

PAST, FUTURE = timedelta(seconds=-30), timedelta(seconds=60)


@dataclass(frozen=True)
class Row:
    bot: int  # 0 or 1
    chat: int
    state: str
    ordered: bool
    send_at: timedelta | None  # relative to now
    due: timedelta  # next_attempt_at relative to now
    broadcast: bool


rows_strategy = st.lists(
    st.builds(
        Row,
        bot=st.integers(0, 1),
        chat=st.integers(1, 2),
        # Waiting states more often: they are where the rule decides something.
        state=st.sampled_from([*[State.PENDING] * 3, *[State.RETRY] * 2, *State.values]),
        ordered=st.sampled_from([True, True, True, False]),
        send_at=st.sampled_from([None, PAST, FUTURE]),
        due=st.sampled_from([PAST, FUTURE]),
        broadcast=st.sampled_from([False, False, False, True]),
    ),
    max_size=14,
).map(
    # A message its sender scheduled for later is not due before then (enqueue sets
    # next_attempt_at to send_at, and nothing brings a waiting row's due time forward).
    lambda rows: [Row(**{**r.__dict__, "due": FUTURE}) if r.send_at == FUTURE else r for r in rows]
)
circuit_strategy = st.sampled_from([None, CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN])


# --------------------------------------------------------------------------- the model
def is_open(row: Row) -> bool:
    if row.state in (State.RETRY, State.SENDING):
        return True
    return row.state == State.PENDING and (row.send_at is None or row.send_at <= timedelta(0))


def model_blocked(rows: list[Row], i: int) -> bool:
    me = rows[i]
    return me.ordered and any(e.ordered and e.bot == me.bot and e.chat == me.chat and is_open(e) for e in rows[:i])


def model_claims(rows: list[Row], bot: int, circuit: str | None) -> set[int]:
    if circuit not in (None, CircuitState.CLOSED):
        return set()
    return {
        i
        for i, row in enumerate(rows)
        if row.bot == bot
        and row.state in (State.PENDING, State.RETRY)
        and row.due <= timedelta(0)
        and not row.broadcast
        and not model_blocked(rows, i)
    }


# ------------------------------------------------------------------------- the tables
def write(rows: list[Row], bots: list, circuits: list[str | None], now: datetime) -> list[OutboundMessage]:
    """The rows in id order (one insert each, so ids grow in list order)."""
    OutboundMessage.objects.all().delete()
    Circuit.objects.all().delete()
    for bot, state in zip(bots, circuits, strict=True):
        if state is not None:
            Circuit.objects.create(scope=f"bot:{bot.pk}", state=state)
    messages = []
    for n, row in enumerate(rows):
        fields: dict = {}
        if row.state == State.SENDING:
            fields.update(lease_owner="elsewhere:1", lease_expires_at=now + FUTURE)
        if row.state == State.SENT:
            fields.update(sent_at=now + PAST)
        messages.append(
            OutboundMessage.objects.create(
                bot=bots[row.bot],
                chat_id=row.chat,
                payload={"text": f"row {n}"},
                idempotency_key=f"head-{n}",
                state=row.state,
                ordered=row.ordered,
                broadcast="bc-1" if row.broadcast else "",
                send_at=None if row.send_at is None else now + row.send_at,
                next_attempt_at=now + row.due,
                **fields,
            )
        )
    return messages


@pytest.fixture
def two_bots(bot_factory) -> list:
    return [bot_factory(), bot_factory()]


HYPOTHESIS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HYPOTHESIS
@given(rows=rows_strategy, circuits=st.lists(circuit_strategy, min_size=2, max_size=2))
def test_claim_batch_claims_exactly_the_heads_the_rule_lets_go(two_bots, rows, circuits) -> None:
    now = timezone.now()
    messages = write(rows, two_bots, circuits, now)
    index = {m.pk: i for i, m in enumerate(messages)}
    for b, bot in enumerate(two_bots):
        claimed = transitions.claim_batch(bot_id=bot.pk, worker="model:1", lease=timedelta(seconds=60), limit=100)
        assert {index[m.pk] for m in claimed} == model_claims(rows, b, circuits[b]), (rows, circuits, b)
        # Never two ordered messages of one chat in one claim.
        heads = [rows[index[m.pk]].chat for m in claimed if rows[index[m.pk]].ordered]
        assert len(heads) == len(set(heads))


@HYPOTHESIS
@given(rows=rows_strategy)
def test_an_ordered_message_is_blocked_exactly_when_an_earlier_open_ordered_message_of_its_chat_exists(
    two_bots, rows
) -> None:
    now = timezone.now()
    messages = write(rows, two_bots, [None, None], now)
    for i, message in enumerate(messages):
        if rows[i].ordered:
            assert selectors.earlier_open_message_exists(message) == model_blocked(rows, i), (rows, i)
