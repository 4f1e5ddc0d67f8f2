"""The bots app's hand-written SQL, each statement named: the router's read of new updates,
the routing mark, the inline runs' claim and done mark, the release of a resumed worker's
runs, the reply guard's upsert and a database thread's connection name. The ORM writes
everything else.

Tables come from the models' `_meta` and states from their choices, put in the text once, at
import: a literal state lets a prepared statement's generic plan use a partial index (the
router's read goes through inbox_new_idx), and a renamed choice cannot leave a statement
behind. bots/transitions.py runs them through core/rows.py (server-side binding, prepared
once per connection); they return plain rows, which transitions.py turns into what its
callers take."""

from __future__ import annotations

from functools import cache

from bots.models import Bot, ChatState, ConsumerRun, InboundUpdate, RunState, UpdateState
from core import rows
from outbox.models import Circuit, CircuitState, ErrorClass

_UPDATES = InboundUpdate._meta.db_table
_RUNS = ConsumerRun._meta.db_table
_CHATS = ChatState._meta.db_table
_BOTS = Bot._meta.db_table
_CIRCUITS = Circuit._meta.db_table

_NEW, _ROUTED = UpdateState.NEW.value, UpdateState.DONE.value
_PENDING, _RUNNING = RunState.PENDING.value, RunState.RUNNING.value
_RETRY, _DONE = RunState.RETRY.value, RunState.DONE.value
_CLOSED = CircuitState.CLOSED.value


@cache
def updates_to_route(*, by_bot: bool, with_circuits: bool) -> str:
    """A bot's new updates (`by_bot`) or one new update, oldest first, each row the update's
    columns then its bot's (`rows.selected_columns`, for `rows.from_row`); `with_circuits`:
    each row ends with those of the given circuit scopes not plainly closed. Parameters:
    [the scopes (text[]),] the bot's or the update's id, the limit. Built on first use: the
    columns need the app registry."""
    unsettled = (
        f", ARRAY(SELECT scope FROM {_CIRCUITS} WHERE scope = ANY(%s::text[])"  # noqa: S608 - names from _meta
        f" AND NOT (state = '{_CLOSED}' AND consecutive_failures = 0))"
        if with_circuits
        else ""
    )
    return (
        f"SELECT {rows.selected_columns(InboundUpdate, 'u')}, {rows.selected_columns(Bot, 'b')}{unsettled}"  # noqa: S608 - names from _meta
        f" FROM {_UPDATES} u JOIN {_BOTS} b ON b.id = u.bot_id"
        f" WHERE u.{'bot_id' if by_bot else 'id'} = %s AND u.state = '{_NEW}'"
        " ORDER BY u.id LIMIT %s"
    )


# new -> done for those of the updates (bigint[]) still new and not being marked by another
# router; RETURNING the ids marked, for rows.insert_many_with to write exactly those updates'
# runs. Parameters: ids, processed_at. SKIP LOCKED: a router never waits for another; a plain
# UPDATE of `id = ANY(…)` locked the rows in the order its scan met them, and two routers
# whose batches overlapped deadlocked.
ROUTE_MARK = (
    f"WITH picked AS MATERIALIZED (SELECT id FROM {_UPDATES} WHERE id = ANY(%s::bigint[])"  # noqa: S608 - names from _meta
    f" AND state = '{_NEW}' FOR UPDATE SKIP LOCKED)"
    f" UPDATE {_UPDATES} u SET state = '{_ROUTED}', processed_at = %s, attempts = u.attempts + 1"
    " FROM picked WHERE u.id = picked.id RETURNING u.id"
)

# pending|retry -> running for the due runs among the ids. Parameters: lease_owner,
# lease_expires_at, updated_at, ids, now. Rows: (id, attempts).
CLAIM_RUNS = f"""UPDATE {_RUNS} SET state = '{_RUNNING}', lease_owner = %s, lease_expires_at = %s,
           attempts = attempts + 1, updated_at = %s
    WHERE id = ANY(%s::bigint[]) AND state IN ('{_PENDING}', '{_RETRY}') AND next_attempt_at <= %s
    RETURNING id, attempts"""  # noqa: S608 - names from _meta, values as parameters

# running -> done, each run with its outcome, for the runs the worker holds. Parameters:
# finished_at, updated_at, ids (bigint[]), outcomes (text[]), lease_owner.
MARK_RUNS_DONE = f"""UPDATE {_RUNS} AS r SET state = '{_DONE}', finished_at = %s, updated_at = %s, lease_owner = '',
           lease_expires_at = NULL, last_error = '', outcome = v.outcome
    FROM unnest(%s::bigint[], %s::text[]) AS v (id, outcome)
    WHERE r.id = v.id AND r.state = '{_RUNNING}' AND r.lease_owner = %s"""  # noqa: S608 - as above

# running -> retry, due now, its attempt given back, for the runs a worker claimed before a
# time and no longer works on. Parameters: next_attempt_at, updated_at, last_error,
# lease_owner, claimed before, ids still alive (bigint[]). Rows: (id,).
RELEASE_OWN_RUNS = f"""UPDATE {_RUNS} SET state = '{_RETRY}', next_attempt_at = %s, lease_owner = '',
           lease_expires_at = NULL, updated_at = %s, max_attempts = max_attempts + 1,
           last_error = %s, last_error_class = '{ErrorClass.TRANSIENT.value}'
    WHERE state = '{_RUNNING}' AND lease_owner = %s AND updated_at < %s AND NOT (id = ANY(%s::bigint[]))
    RETURNING id"""  # noqa: S608 - as above

# Each chat's reply guard made, or moved forward to its newest answered message; the rows
# locked in chat-id order (ORDER BY), so that two routers whose batches share chats cannot
# deadlock. Parameters: bot_id, last_answered_at, updated_at, chat ids, message ids (bigint[]).
NOTE_CHATS_ANSWERED = f"""INSERT INTO {_CHATS} (bot_id, chat_id, last_answered_message_id, last_answered_at, updated_at)
    SELECT %s, chat_id, message_id, %s, %s FROM unnest(%s::bigint[], %s::bigint[]) AS a(chat_id, message_id)
    ORDER BY chat_id
    ON CONFLICT (bot_id, chat_id) DO UPDATE SET
      last_answered_message_id = GREATEST({_CHATS}.last_answered_message_id, EXCLUDED.last_answered_message_id),
      last_answered_at = EXCLUDED.last_answered_at, updated_at = EXCLUDED.updated_at"""  # noqa: S608 - as above

# A connection's name in pg_stat_activity (application_name), for the session. Parameter: the name.
SET_APPLICATION_NAME = "SELECT set_config('application_name', %s, false)"
