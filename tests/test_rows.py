"""core/rows.py's insert of a row given as values (the webhook's one statement), its
statements committed asynchronously, against a PostgreSQL the tests crash, and the instances it
builds, held to what the ORM builds."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from django.db import DataError, connection, transaction
from django.utils import timezone

from bots.models import AnalyticsEvent, ConsumerRun, InboundUpdate, RunState, UpdateState
from core import rows
from outbox import selectors, transitions
from outbox.models import Attempt, OutboundMessage, State
from tests.conftest import make_bot
from tests.private_postgres import PrivatePostgres, django_connection_at, remove_clusters_of_dead_runs

pytestmark = pytest.mark.django_db


def _values(bot, update_id: int, **more) -> dict:
    now = timezone.now()
    values = {"bot_id": bot.pk, "update_id": update_id, "payload": {"update_id": update_id}, "trace_id": "t"}
    return {**values, "next_attempt_at": now, "received_at": now, **more}


def test_a_row_given_as_values_is_inserted_once_and_the_rest_takes_the_fields_defaults(bot) -> None:
    pk = rows.insert_values_once(InboundUpdate, _values(bot, 1), unique=("bot_id", "update_id"))

    assert pk is not None
    update = InboundUpdate.objects.get(pk=pk)
    assert (update.state, update.attempts, update.last_error, update.update_type) == (UpdateState.NEW, 0, "", "")
    assert update.chat_id is None
    assert update.processed_at is None
    assert update.payload == {"update_id": 1}
    assert rows.insert_values_once(InboundUpdate, _values(bot, 1), unique=("bot_id", "update_id")) is None
    assert InboundUpdate.objects.count() == 1


def test_json_given_as_text_is_stored_as_the_value_it_encodes(bot) -> None:
    text = rows.JSONText('{"update_id": 2, "message": {"text": "as it came"}}')

    pk = rows.insert_values_once(InboundUpdate, _values(bot, 2, payload=text), unique=("bot_id", "update_id"))

    assert InboundUpdate.objects.get(pk=pk).payload == {"update_id": 2, "message": {"text": "as it came"}}


def test_a_field_without_a_constant_default_must_be_given(bot) -> None:
    values = _values(bot, 3)
    del values["received_at"]  # auto_now_add: the caller's to give

    with pytest.raises(TypeError, match="received_at has no constant default"):
        rows.insert_values_once(InboundUpdate, values, unique=("bot_id", "update_id"))
    assert not InboundUpdate.objects.exists()


def test_rows_inserted_in_one_statement_keep_their_values_and_get_their_pks_and_timestamps(bot) -> None:
    payload = {"update_id": 5, "message": {"text": 'Привет 👋 "x" \\ y', "entities": [{"offset": 0}]}}
    now = timezone.now()
    first = InboundUpdate(bot=bot, update_id=5, payload=payload, trace_id="a", next_attempt_at=now, chat_id=-(2**62))
    rows.insert_once(
        InboundUpdate(bot=bot, update_id=6, payload={}, trace_id="b", next_attempt_at=now),
        unique=("bot_id", "update_id"),
    )
    taken = InboundUpdate(bot=bot, update_id=6, payload={}, trace_id="c", next_attempt_at=now)

    assert rows.insert_many_once([first, taken], unique=("bot_id", "update_id")) == 1

    assert taken.pk is None
    stored = InboundUpdate.objects.get(pk=first.pk)
    assert stored.payload == payload
    assert stored.chat_id == -(2**62)
    assert stored.next_attempt_at == now
    assert stored.received_at is not None  # auto_now_add, as save() sets it
    assert stored.received_at == first.received_at


def test_rows_whose_json_orjson_refuses_are_inserted_as_json_encodes_them(bot) -> None:
    # Keys that are not strs, an int past 64 bits, a lone surrogate: orjson refuses them
    # and json encodes them, as before (a lone surrogate is refused by PostgreSQL's jsonb).
    now = timezone.now()
    payload = {1: "an int key", "big": 2**70, "nested": [{"n": 1.5}]}
    update = InboundUpdate(bot=bot, update_id=7, payload=payload, trace_id="a", next_attempt_at=now)
    lone = InboundUpdate(bot=bot, update_id=8, payload={"text": "\ud800"}, trace_id="b", next_attempt_at=now)

    assert rows.insert_many_once([update], unique=("bot_id", "update_id")) == 1
    with pytest.raises(DataError), transaction.atomic():
        rows.insert_many_once([lone], unique=("bot_id", "update_id"))

    assert InboundUpdate.objects.get(pk=update.pk).payload == {"1": "an int key", "big": 2**70, "nested": [{"n": 1.5}]}
    assert list(InboundUpdate.objects.values_list("update_id", flat=True)) == [7]


def test_a_float_column_that_is_not_a_number_is_refused_not_written_as_null(bot) -> None:
    now = timezone.now()
    message = OutboundMessage.objects.create(
        bot=bot, chat_id=1, idempotency_key="k", payload={"text": "x"}, next_attempt_at=now
    )
    nan = Attempt(message=message, number=1, started_at=now, retry_after=float("nan"))
    finite = Attempt(message=message, number=2, started_at=now, retry_after=2.5)

    with pytest.raises(ValueError, match="Out of range float"):
        rows.insert_many_once([nan], unique=("message_id", "number"))
    assert rows.insert_many_once([finite], unique=("message_id", "number")) == 1

    assert list(Attempt.objects.values_list("number", "retry_after")) == [(2, 2.5)]


def test_times_of_any_zone_and_enum_values_go_in_as_the_values_they_are(bot) -> None:
    from zoneinfo import ZoneInfo

    at = datetime(2026, 7, 1, 2, 30, tzinfo=ZoneInfo("Europe/Berlin"))
    later = datetime(2026, 12, 7, 12, 0, 0, 123456, tzinfo=ZoneInfo("Asia/Kolkata"))
    update = InboundUpdate(bot=bot, update_id=9, payload={}, trace_id="a", next_attempt_at=at, received_at=later)
    update.state = UpdateState.DONE

    rows.insert_many_once([update], unique=("bot_id", "update_id"))

    stored = InboundUpdate.objects.get(pk=update.pk)
    assert (stored.next_attempt_at, stored.state) == (at, UpdateState.DONE)
    assert stored.received_at != later  # auto_now_add: set as save() sets it
    assert stored.received_at == update.received_at


def _synchronous_commit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return cursor.fetchone()[0]


@pytest.fixture(scope="module")
def crashable_postgres() -> Iterator[PrivatePostgres]:
    """A cluster of this module's own, which the tests below crash (never the shared server).
    Its WAL writer wakes every 10 s, the longest PostgreSQL allows, so that an asynchronous
    commit stays in shared memory, where a crash loses it, until something writes it."""
    remove_clusters_of_dead_runs()
    server = PrivatePostgres(settings={"wal_writer_delay": "10s"}).init()
    server.start()
    try:
        server.create_database("crash_template")
        server.migrate("crash_template")
        yield server
    finally:
        server.stop()


_crash_databases = itertools.count(1)


@pytest.fixture
def crashable_db(crashable_postgres: PrivatePostgres, transactional_db: None) -> Iterator[PrivatePostgres]:
    """A fresh database of the crashable cluster, this process's connection on it."""
    name = f"crash_{next(_crash_databases)}"
    crashable_postgres.create_database(name, template="crash_template")
    with django_connection_at(crashable_postgres, name):
        yield crashable_postgres
    if not crashable_postgres.running():
        crashable_postgres.start()
    crashable_postgres.drop_database(name)


def _claimed_by_alice_in_memory_only(db: PrivatePostgres, sandbox_url: str) -> tuple[OutboundMessage, OutboundMessage]:
    """A due message (committed, on disk), and alice's claim of it, committed asynchronously
    and so still in PostgreSQL's memory only (its WAL writer wakes every 10 s)."""
    message = OutboundMessage.objects.create(
        bot=make_bot(sandbox_url),
        chat_id=42,
        idempotency_key="k",
        payload={"text": "hi"},
        next_attempt_at=timezone.now(),
    )
    [claimed] = transitions.claim_batch(bot_id=message.bot_id, worker="alice", lease=timedelta(minutes=5), limit=1)
    assert db.unwritten_wal() > 0, "the claim waited for the disk: not committed asynchronously"
    return message, claimed


@pytest.mark.django_db(transaction=True)
def test_an_asynchronous_claim_is_on_disk_once_the_attempt_after_it_commits_even_if_the_postmaster_is_killed(
    crashable_db: PrivatePostgres, sandbox_server
) -> None:
    # What the asynchronous commits rely on: a later synchronous commit on the connection
    # (the attempt row, before any request) waits for the disk, and for this claim with it.
    message, claimed = _claimed_by_alice_in_memory_only(crashable_db, sandbox_server.base_url)

    attempts = transitions.begin_attempts([claimed], worker="alice")
    crashable_db.kill_postmaster()
    crashable_db.start()
    connection.close()

    row = OutboundMessage.objects.get(pk=message.pk)
    assert (row.state, row.lease_owner, row.attempts) == (State.SENDING, "alice", 1)
    assert list(row.attempt_set.values_list("pk", "number", "finished_at")) == [(attempts[message.pk].pk, 1, None)]


@pytest.mark.django_db(transaction=True)
def test_a_message_whose_asynchronous_claim_a_crash_lost_is_claimable_again_and_its_claimer_cannot_send_it(
    crashable_db: PrivatePostgres, sandbox_server
) -> None:
    message, claimed = _claimed_by_alice_in_memory_only(crashable_db, sandbox_server.base_url)

    crashable_db.crash()  # pg_ctl stop -m immediate: the claim was still in memory
    crashable_db.start()
    connection.close()

    row = OutboundMessage.objects.get(pk=message.pk)
    assert (row.state, row.lease_owner, row.attempts) == (State.PENDING, "", 0)  # not stuck in sending
    # Alice, who believes she holds it, gets no attempt, so she sends nothing.
    assert transitions.begin_attempts([claimed], worker="alice") == {}
    [again] = transitions.claim_batch(bot_id=message.bot_id, worker="bob", lease=timedelta(minutes=5), limit=1)
    assert again.pk == message.pk
    assert list(transitions.begin_attempts([again], worker="bob")) == [message.pk]
    assert list(Attempt.objects.filter(message=message).values_list("number", "worker")) == [(1, "bob")]


@pytest.mark.django_db(transaction=True)
def test_inside_an_atomic_block_the_statement_commits_with_the_block_and_as_the_block_says() -> None:
    with transaction.atomic():
        assert rows.fetch("SELECT current_setting('synchronous_commit')", [], async_commit=True) == [("on",)]
        assert _synchronous_commit() == "on"  # the block's own commit still waits for the disk


@pytest.mark.django_db(transaction=True)
def test_a_failing_statement_committed_asynchronously_raises_as_any_and_the_connection_goes_on() -> None:
    with pytest.raises(DataError, match="division by zero"):
        rows.fetch("SELECT 1 / %s", [0], async_commit=True)

    assert rows.fetch("SELECT 2", []) == [(2,)]
    assert _synchronous_commit() == "on"


def _fields(row) -> dict:
    return {k: v for k, v in vars(row).items() if k != "_state"}


def test_a_new_row_is_the_instance_the_models_constructor_makes(bot) -> None:
    now = timezone.now()
    update = InboundUpdate(bot=bot, update_id=7, payload={}, trace_id="t", next_attempt_at=now)
    values = {"update": update, "bot_id": bot.pk, "consumer": "echo", "next_attempt_at": now, "trace_id": "t"}

    made, built = rows.new(ConsumerRun, **values), ConsumerRun(**values)

    assert _fields(made) == _fields(built)
    assert made.update is update  # cached as the descriptor caches it: no query to read it back
    assert (made.state, made.attempts, made.max_attempts, made.lease_expires_at) == (RunState.PENDING, 0, 5, None)
    assert (made._state.adding, made._state.db) == (True, None)
    # A callable default is called for each row, not shared.
    first, second = rows.new(OutboundMessage, bot=bot, chat_id=1), rows.new(OutboundMessage, bot=bot, chat_id=1)
    assert first.payload == {}
    assert first.payload is not second.payload
    assert _fields(first) == _fields(OutboundMessage(bot=bot, chat_id=1))
    # A one-to-one's row gets the new row in its cache too, as the descriptor does.
    event = rows.new(AnalyticsEvent, update=update, bot_id=bot.pk, update_type="message")
    assert update.analytics_event is event
    assert _fields(event) == _fields(AnalyticsEvent(update=update, bot_id=bot.pk, update_type="message"))
    update.save()
    made.save()
    assert ConsumerRun.objects.get(pk=made.pk).update_id == update.pk


def _columns(row) -> dict:
    return {f.attname: getattr(row, f.attname) for f in row._meta.concrete_fields}


def test_a_related_row_attached_is_what_select_related_gives(bot, django_assert_num_queries) -> None:
    message = OutboundMessage.objects.create(
        bot=bot, chat_id=1, idempotency_key="k", payload={"text": "x"}, next_attempt_at=timezone.now()
    )
    expected = OutboundMessage.objects.select_related("bot").get(pk=message.pk)

    # The drain's way: the bot it holds, on each message it claims.
    attached = OutboundMessage.objects.get(pk=message.pk)
    rows.attach_related(attached, "bot", type(bot).objects.get(pk=bot.pk))
    # The single send's: the message and its bot read by one fixed statement (outbox/sql.py).
    read = selectors.outbound_message_for_send(message.pk, now=timezone.now())

    for built in (attached, read):
        assert built == expected
        assert _columns(built) == _columns(expected)
        assert (built._state.adding, built._state.db) == (expected._state.adding, expected._state.db)
        assert built._state.fields_cache.keys() == expected._state.fields_cache.keys() == {"bot"}
        with django_assert_num_queries(0):
            assert _columns(built.bot) == _columns(expected.bot)
        assert built.bot.pk == built.bot_id


def test_the_hot_paths_statements_run_on_djangos_cursor(bot) -> None:
    seen = []

    def wrapper(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        assert rows.fetch("SELECT %s::int + 1", [1]) == [(2,)]
        with pytest.raises(DataError, match="division by zero"):  # Django's error, not psycopg's
            rows.execute("SELECT 1 / %s", [0])

    assert seen == ["SELECT %s::int + 1", "SELECT 1 / %s"]


def test_what_a_new_row_cannot_take_goes_to_the_models_constructor_and_its_errors() -> None:
    with pytest.raises(TypeError, match="unexpected keyword arguments: 'no_such_field'"):
        rows.new(ConsumerRun, consumer="echo", no_such_field=1)
    assert rows.new(ConsumerRun, update=None).update_id is None


def test_times_read_by_the_hot_paths_statements_are_the_aware_utc_times_the_orm_reads(bot) -> None:
    pk = rows.insert_values_once(InboundUpdate, _values(bot, 8), unique=("bot_id", "update_id"))
    orm = InboundUpdate.objects.get(pk=pk)

    [(received, next_attempt, processed)] = rows.fetch(
        "SELECT received_at, next_attempt_at, processed_at FROM bots_inboundupdate WHERE id = %s", [pk]
    )

    assert (received, next_attempt, processed) == (orm.received_at, orm.next_attempt_at, None)
    assert received.tzinfo is orm.received_at.tzinfo is UTC
    [(far,)] = rows.fetch("SELECT '9999-12-31 23:59:59.999999+00'::timestamptz", [])
    assert far == datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)


def test_lists_bound_to_the_hot_paths_statements_arrive_as_the_arrays_they_are() -> None:
    ids, flags, texts = [1, None, -(2**63), 2**63 - 1], [True, False], ['a "b", {c}', "d\\e", "NULL", None]

    [row] = rows.fetch(
        "SELECT %s::bigint[], %s::boolean[], %s::text[], %s::bigint[], cardinality(%s::bigint[])",
        [ids, flags, texts, [], [7] * 50],
    )

    assert row == (ids, flags, texts, [], 50)
    # Compared with = ANY, a list of ids takes the column's type.
    assert rows.fetch("SELECT 3::bigint = ANY(%s), 4::bigint = ANY(%s)", [[1, 2, 3], [5]]) == [(True, False)]
