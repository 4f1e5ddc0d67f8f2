"""The outbox's hand-written SQL, every statement in one place and named (migrations aside).

The send path's statements are written by hand for their CPU (docs/DESIGN.md); the rules they
share (a chat's order, a circuit that holds its bot) are fragments here, written once. Table
names come from the models' _meta and states from their choices, put in the text once; values
are always parameters. They run through Django's cursor: the hot ones through core/rows.py
(`fetch`, `execute`: prepared once per connection), the rest through `connection.cursor()`.
What they return is plain tuples, or model instances built here (`message`,
`bot_and_circuit_of`) as a queryset would build them."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

from django.db import connection
from django.db.models import Model

from core import rows
from outbox.circuits import BOT_PREFIX
from outbox.models import ATTEMPT_OK, Attempt, Circuit, CircuitState, OutboundMessage, State


def _states(*states: str) -> str:
    """States as the SQL list of their values, for `state IN (...)`."""
    return ", ".join(f"'{state}'" for state in states)


MESSAGES = OutboundMessage._meta.db_table
ATTEMPTS = Attempt._meta.db_table
CIRCUITS = Circuit._meta.db_table
_UPDATES = OutboundMessage._meta.get_field("source_update").related_model._meta.db_table  # type: ignore[union-attr]

_WAITING = _states(State.PENDING, State.RETRY)
_SENDING, _SENT = f"'{State.SENDING}'", f"'{State.SENT}'"


def bot_model() -> type[Model]:
    """The bot model, through the outbox's foreign key: outbox imports nothing from bots."""
    return OutboundMessage._meta.get_field("bot").related_model  # type: ignore[return-value]


# --- rules, as fragments of the statements below ------------------------------------------


def _blocked(alias: str, earlier: str, now: str) -> str:
    # outbox/chat_order.py: an ordered message waits while an earlier ordered message of its
    # chat is open (retry, sending, or pending and due).
    return f"""({alias}.ordered AND EXISTS (
        SELECT 1 FROM {MESSAGES} e WHERE e.bot_id = {alias}.bot_id AND e.chat_id = {alias}.chat_id
          {earlier} AND e.ordered AND e.state IN ({_states(State.PENDING, State.RETRY, State.SENDING)})
          AND (e.state IN ({_states(State.RETRY, State.SENDING)}) OR e.send_at IS NULL OR e.send_at <= {now})))"""  # noqa: S608


@cache
def blocked(alias: str) -> str:
    """SQL true when the row `alias` must wait for an earlier message of its chat
    (outbox/chat_order.py). Takes one parameter, now."""
    return _blocked(alias, f"AND e.id < {alias}.id", "%s")


def blocked_new(alias: str, now: str) -> str:
    """`blocked` for a row about to be written (`alias`, not in the table yet): every message
    of its chat is earlier than it. `now` is the SQL of the current time (a named parameter)."""
    return _blocked(alias, "", now)


def circuit_not_closed(scope: str) -> str:
    """SQL true when the circuit of `scope` (SQL: a parameter or an expression) is not
    closed: what holds every send of its bot but a probe (outbox/circuits.py)."""
    return f"EXISTS (SELECT 1 FROM {CIRCUITS} c WHERE c.scope = {scope} AND c.state <> '{CircuitState.CLOSED}')"  # noqa: S608


def circuit_has_failures(scope: str) -> str:
    """SQL true when the circuit of `scope` has failures counted, which a success must reset."""
    return f"EXISTS (SELECT 1 FROM {CIRCUITS} c WHERE c.scope = {scope} AND c.consecutive_failures > 0)"  # noqa: S608


# Held until the writer's transaction ends; taken in key order (outbox/chat_order.py
# write_lock), so two writers of the same chats never wait for each other in a circle.
CHAT_WRITE_LOCK = "SELECT pg_advisory_xact_lock(k) FROM unnest(%s::bigint[]) AS k"


# --- the send path's transitions (outbox/transitions.py) ------------------------------------

# pending|retry -> sending, for one message: worker, lease until, now, id, now.
CLAIM = (
    f"UPDATE {MESSAGES} SET state = {_SENDING}, lease_owner = %s, lease_expires_at = %s, updated_at = %s"  # noqa: S608
    f" WHERE id = %s AND state IN ({_WAITING}) AND next_attempt_at <= %s"
)
# CLAIM, and only while the row is unchanged since a time: ..., that time.
CLAIM_UNCHANGED = CLAIM + " AND updated_at = %s"

_MESSAGE_COLUMNS = rows.selected_columns(OutboundMessage, "m")


@cache
def claim_batch(*, bulk: bool, by_ids: bool) -> str:
    """pending|retry -> sending for up to a limit of a bot's due messages, oldest due first,
    skipping rows another worker holds, chats whose order holds them and everything while
    the bot's circuit is not closed; returns each message's columns and whether its circuit
    has failures to forget. `bulk`: broadcasts only, else replies only. Parameters: bot id,
    now, due since, [ids], now, scope, limit, worker, lease until, now, scope. Why a CTE and
    no tie-break in the order: docs/DESIGN.md (`claim_batch`)."""
    lane = "q.broadcast <> ''" if bulk else "q.broadcast = ''"
    return f"""
        WITH picked AS MATERIALIZED (
          SELECT q.id FROM {MESSAGES} q
          WHERE q.bot_id = %s AND q.state IN ({_WAITING}) AND q.next_attempt_at <= %s
            AND q.next_attempt_at >= %s AND {lane}{" AND q.id = ANY(%s)" if by_ids else ""}
            AND NOT {blocked("q")}
            AND NOT {circuit_not_closed("%s")}
          ORDER BY q.next_attempt_at
          LIMIT %s
          FOR UPDATE SKIP LOCKED
        )
        UPDATE {MESSAGES} m SET state = {_SENDING}, lease_owner = %s, lease_expires_at = %s, updated_at = %s
        FROM picked WHERE m.id = picked.id AND m.state IN ({_WAITING})
        RETURNING {_MESSAGE_COLUMNS},
          {circuit_has_failures("%s")}
    """  # noqa: S608 - names from _meta, values as parameters


# write_many_claimed's insert (core/rows.py insert_many_computed): the columns its statement
# decides, where `x.go` (WRITTEN_CLAIMED_GOES) is whether a claim would take the row now.
WRITTEN_CLAIMED = {
    "state": f"CASE WHEN x.go THEN {_SENDING} ELSE r.state END",
    "lease_owner": "CASE WHEN x.go THEN %(worker)s ELSE r.lease_owner END",
    "lease_expires_at": "CASE WHEN x.go THEN %(until)s ELSE r.lease_expires_at END",
}
# `first_in_chat`: per row of the statement, whether no earlier ordered row of its chat is in it.
WRITTEN_CLAIMED_GOES = f"""SELECT r.state = '{State.PENDING}' AND r.broadcast = '' AND r.next_attempt_at <= %(now)s
        AND (r.send_at IS NULL OR r.send_at <= %(now)s) AND (%(first_in_chat)s::boolean[])[r.ordinality]
        AND NOT {blocked_new("r", "%(now)s")}
        AND NOT {circuit_not_closed("%(scope)s")} AS go"""
WRITTEN_CLAIMED_RETURNING = f"state = {_SENDING}, {circuit_has_failures('%(scope)s')}"

# sending -> sending with one more attempt, and its attempt row, for the messages this worker
# holds: now, ids, worker, worker, now. Returns (attempt id, message id, number).
BEGIN_ATTEMPTS = f"""WITH m AS (
              UPDATE {MESSAGES} SET attempts = attempts + 1, updated_at = %s
              WHERE id = ANY(%s::bigint[]) AND state = {_SENDING} AND lease_owner = %s RETURNING id, attempts
            )
            INSERT INTO {ATTEMPTS} (message_id, number, worker, started_at, finished_at, outcome,
                                     http_status, error_code, description, retry_after)
            SELECT id, attempts, %s, %s, NULL, '', NULL, NULL, '', NULL FROM m
            RETURNING id, message_id, number"""  # noqa: S608

# sending -> sent, and each attempt finished ok: message ids, attempt ids, Telegram's message
# ids, results (JSON text or NULL), now, attempt ids, now, now, message ids, worker. The ids
# again as `= ANY`: the planner then reads the rows by primary key (joined to the unnest alone
# it scanned the lease index's dead entries). Returns (id, bot id, chat id, its update's
# received_at) of each message marked.
MARK_SENT = f"""WITH v AS (
              SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::text[])
                AS v(message_id, attempt_id, telegram_message_id, result)
            ), a AS (
              UPDATE {ATTEMPTS} SET finished_at = %s, outcome = '{ATTEMPT_OK}', http_status = 200, error_code = NULL,
                description = '', retry_after = NULL
              FROM v WHERE {ATTEMPTS}.id = v.attempt_id AND {ATTEMPTS}.id = ANY(%s::bigint[])
            ), m AS (
              UPDATE {MESSAGES} SET state = {_SENT}, sent_at = %s, updated_at = %s,
                telegram_message_id = v.telegram_message_id, result = v.result::jsonb, lease_owner = '',
                lease_expires_at = NULL, last_error = '', last_error_class = ''
              FROM v WHERE {MESSAGES}.id = v.message_id AND {MESSAGES}.id = ANY(%s::bigint[])
                AND {MESSAGES}.state = {_SENDING} AND {MESSAGES}.lease_owner = %s
              RETURNING {MESSAGES}.id, {MESSAGES}.bot_id, {MESSAGES}.chat_id,
                {MESSAGES}.source_update_id
            )
            SELECT m.id, m.bot_id, m.chat_id,
              (SELECT u.received_at FROM {_UPDATES} u WHERE u.id = m.source_update_id)
            FROM m"""  # noqa: S608


# --- reads (outbox/selectors.py) ------------------------------------------------------------

# Each chat's head, waiting and due, for (message id, bot id, chat id) triples: now, now,
# message ids, bot ids, chat ids. Returns (message id, its chat's head or NULL).
NEXT_OPEN_IN_CHATS = f"""SELECT v.id, (SELECT h.id FROM {MESSAGES} h WHERE h.bot_id = v.bot_id AND h.chat_id = v.chat_id
                   AND h.state IN ({_WAITING}) AND h.next_attempt_at <= %s
                   AND NOT {blocked("h")} ORDER BY h.id LIMIT 1)
            FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[]) AS v(id, bot_id, chat_id)"""  # noqa: S608

# A bot's circuit: scope.
CIRCUIT = f"SELECT {rows.selected_columns(Circuit, 'c')} FROM {CIRCUITS} c WHERE c.scope = %s"  # noqa: S608


@cache
def for_send() -> str:
    """A message, its bot, whether the bot's circuit is not closed, whether it has failures
    to forget, and whether the chat's order holds the message: now, message id. The
    open-states test lets PostgreSQL use outbox_open_chat_idx for the chat's order."""
    bots = bot_model()._meta.db_table
    bot_scope = f"'{BOT_PREFIX}' || m.bot_id::text"
    return f"""
        SELECT {_MESSAGE_COLUMNS}, {rows.selected_columns(bot_model(), "b")},
          {circuit_not_closed(bot_scope)},
          EXISTS (SELECT 1 FROM {CIRCUITS} c WHERE c.scope = {bot_scope}
                    AND NOT (c.state = '{CircuitState.CLOSED}' AND c.consecutive_failures = 0)),
          {blocked("m")}
        FROM {MESSAGES} m JOIN {bots} b ON b.id = m.bot_id
        WHERE m.id = %s
    """  # noqa: S608 - names from _meta, values as parameters


@cache
def bot_and_circuit() -> str:
    """A bot and its circuit (NULLs where it has none): scope, bot id."""
    bot = bot_model()
    columns = f"{rows.selected_columns(bot, 'b')}, {rows.selected_columns(Circuit, 'c')}"
    return f"SELECT {columns} FROM {bot._meta.db_table} b LEFT JOIN {CIRCUITS} c ON c.scope = %s WHERE b.id = %s"  # noqa: S608


# --- what the statements return, as instances -----------------------------------------------

_N_MESSAGE = len(OutboundMessage._meta.concrete_fields)


def message(values: Iterable[Any]) -> OutboundMessage:
    """An OutboundMessage from a row starting with its columns (CLAIM_BATCH's, FOR_SEND's)."""
    return rows.from_row(OutboundMessage, list(values)[:_N_MESSAGE])  # type: ignore[return-value]


def message_with_bot(row: tuple[Any, ...]) -> tuple[OutboundMessage, tuple[Any, ...]]:
    """`for_send`'s row: the message, its bot cached on it as select_related("bot") would,
    and the row's remaining values."""
    n_bot = len(bot_model()._meta.concrete_fields)
    found = message(row)
    rows.attach_related(found, "bot", rows.from_row(bot_model(), row[_N_MESSAGE : _N_MESSAGE + n_bot]))
    return found, row[_N_MESSAGE + n_bot :]


def bot_and_circuit_of(row: tuple[Any, ...]) -> tuple[Model, Circuit | None]:
    """`bot_and_circuit`'s row: the bot, and its circuit or None."""
    n_bot = len(bot_model()._meta.concrete_fields)
    circuit = rows.from_row(Circuit, row[n_bot:]) if row[n_bot] is not None else None
    return rows.from_row(bot_model(), row[:n_bot]), circuit  # type: ignore[return-value]


# --- retention (outbox/retention.py delete_rows) --------------------------------------------


@cache
def set_null(model: type[Model], column: str) -> str:
    """`column` of `model`'s rows set NULL where it holds one of the ids (a parameter)."""
    table, column = _quoted(model, column)
    return f"UPDATE {table} SET {column} = NULL WHERE {column} = ANY(%s)"  # noqa: S608


@cache
def ids_where(model: type[Model], column: str) -> str:
    """The ids of `model`'s rows whose `column` holds one of the ids (a parameter)."""
    table, column = _quoted(model, column)
    pk = connection.ops.quote_name(model._meta.pk.column)  # type: ignore[arg-type]
    return f"SELECT {pk} FROM {table} WHERE {column} = ANY(%s)"  # noqa: S608


@cache
def delete_where(model: type[Model], column: str) -> str:
    """Delete `model`'s rows whose `column` holds one of the ids (a parameter)."""
    table, column = _quoted(model, column)
    return f"DELETE FROM {table} WHERE {column} = ANY(%s)"  # noqa: S608


def _quoted(model: type[Model], column: str) -> tuple[str, str]:
    return connection.ops.quote_name(model._meta.db_table), connection.ops.quote_name(column)
