"""The hot paths' rows: inserting them once, in one statement (`INSERT … ON CONFLICT DO
NOTHING`: the webhook's update, a one-message enqueue, a routed update's consumer runs; no
SELECT first, no savepoint), running the apps' fixed statements (`fetch`, `execute`, on
Django's cursor, prepared once per connection), and building instances from their rows as the
ORM would (`from_row`, `new`, `attach_related`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime
from functools import cache, partial
from operator import itemgetter
from typing import Any, TypeVar

import orjson
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import FloatField, JSONField, Model, signals
from django.db.models.base import ModelState


@cache
def _fields(model: type[Model]) -> list[Any]:
    return [f for f in model._meta.concrete_fields if not f.primary_key]


def _insert(model: type[Model], unique: tuple[str, ...], source: str) -> str:
    """INSERT of `source` (VALUES or a SELECT giving the model's columns, pk aside) that skips
    rows whose `unique` columns are taken and returns (pk, *unique) of those it wrote."""
    qn = connection.ops.quote_name
    returning = ", ".join(qn(c) for c in (model._meta.pk.column, *unique))
    return (
        f"INSERT INTO {qn(model._meta.db_table)} ({_columns(model)}) {source} "
        f"ON CONFLICT ({', '.join(qn(c) for c in unique)}) DO NOTHING RETURNING {returning}"
    )


def _columns(model: type[Model], alias: str = "") -> str:
    return ", ".join(alias + connection.ops.quote_name(f.column) for f in _fields(model))


def _set_on_save(f: Any) -> bool:
    """auto_now and auto_now_add: a value save() sets, never a constant default."""
    return getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False)


@cache
def _sql(model: type[Model], unique: tuple[str, ...]) -> str:
    row = "(" + ", ".join(["%s"] * len(_fields(model))) + ")"
    return _insert(model, unique, "VALUES " + row)


@cache
def _sql_columns(model: type[Model], unique: tuple[str, ...]) -> str:
    """`_sql` for any number of rows: the rows as one JSON array of objects
    (`_rows_json`) that PostgreSQL turns into rows of the table's own type, so the statement's
    text, prepared once per connection, is the same whatever the count. One JSON text, not
    one array per column: psycopg dumps arrays element by element in Python, several times the
    CPU of one json.dumps."""
    return _insert(model, unique, _rows_source(model))


def _rows_source(model: type[Model], alias: str = "") -> str:
    table = connection.ops.quote_name(model._meta.db_table)
    return f"SELECT {_columns(model, alias)} FROM json_populate_recordset(NULL::{table}, %s::json)"  # noqa: S608 - names from _meta


def _rows_json(rows: list[Model]) -> str:
    """The rows' values to insert as a JSON array of {column: value}, taken from the
    instances as they are (ints, strs, aware datetimes in ISO 8601, a JSON field's value nested)
    rather than through each field's get_db_prep_save; an auto_now(_add) field is set as save()
    would. Encoded by orjson; what it refuses goes to json, whose errors callers see. orjson
    writes NaN as null: a model with a float column is encoded by json, and the outbox refuses a
    payload holding NaN at enqueue (`call_fingerprint`). Why: docs/DESIGN.md."""
    model = type(rows[0])
    for f in _dated(model):
        for row in rows:
            f.pre_save(row, True)
    columns, take, floats = _json_plan(model)
    values = [dict(zip(columns, take(vars(row)), strict=True)) for row in rows]
    if not floats:
        try:
            return orjson.dumps(values).decode()
        except orjson.JSONEncodeError:
            pass
    return json.dumps(values, default=_json_value, allow_nan=False)


@cache
def _json_plan(model: type[Model]) -> tuple[tuple[str, ...], Callable[[dict[str, Any]], tuple[Any, ...]], bool]:
    """The model's columns, a function taking their values from an instance's __dict__, and
    whether a column holds floats."""
    fields = _fields(model)
    attnames = [f.attname for f in fields]
    take = itemgetter(*attnames) if len(attnames) > 1 else lambda values: (values[attnames[0]],)
    floats = any(isinstance(f, FloatField) for f in fields)
    return tuple(f.column for f in fields), take, floats


@cache
def _dated(model: type[Model]) -> list[Any]:
    return [f for f in _fields(model) if _set_on_save(f)]


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    raise TypeError(f"rows: no JSON form for {type(value).__name__} {value!r}")


def selected_columns(model: type[Model], alias: str) -> str:
    """Every concrete field's column of `model` under `alias`, in the order `from_row` reads."""
    return ", ".join(f'{alias}."{f.column}"' for f in model._meta.concrete_fields)


@cache
def _row_plan(model: type[Model]) -> list[tuple[int, Any, list[Callable[..., Any]]]]:
    """The concrete fields whose values the ORM converts as it reads them (a JSONField's text
    decoded): their place in a row, their column expression and those converters."""
    plan = []
    for i, f in enumerate(model._meta.concrete_fields):
        col = f.get_col(model._meta.db_table)
        converters = connection.ops.get_db_converters(col) + f.get_db_converters(connection)
        if converters:
            plan.append((i, col, converters))
    return plan


def from_row(model: type[Model], values: tuple[Any, ...] | list[Any]) -> Model:
    """An instance of `model` from a fixed statement's `selected_columns`, as a queryset
    builds it (each field's converters applied, then Model.from_db), without the queryset's
    compile, which cost more than the hot path's reads themselves."""
    converted = list(values)
    for i, col, converters in _row_plan(model):
        for convert in converters:
            converted[i] = convert(converted[i], col, connection)
    return model.from_db(DEFAULT_DB_ALIAS, None, converted)


def attach_related(instance: Model, name: str, related: Model | None) -> None:
    """Cache `related` as `instance`'s foreign key `name`, as select_related(name) does, so that
    reading `instance.<name>` costs no query. Why not the ORM's own way: the hot paths read
    the related row in their own statement (a message and its bot), or hold it already (the
    drain's bot, for every message it claims), and a queryset's select_related would compile
    a query, or the descriptor's assignment check the instance, for each. The cache is written
    as the field's set_cached_value writes it (a forward relation's cache name is its name),
    without looking the field up per row. The one place the apps touch a model's relation
    cache; tests/test_rows.py holds it to select_related's result."""
    instance._state.fields_cache[name] = related


M = TypeVar("M", bound=Model)


def new(model: type[M], /, **values: Any) -> M:
    """`model(**values)` for the hot paths' new rows, the same instance built without
    Model.__init__'s descriptor calls and default look-ups per field (docs/PERFORMANCE.md): each
    field's value as given (a foreign key by its attname, or by its name as an instance, then
    cached on the row, and a one-to-one's row on it, as the descriptor caches them) or its
    default. Anything else Model.__init__ would do differently (a property or an unknown name
    among the values, a parent link, receivers of pre_init or post_init) takes Model.__init__
    itself."""
    plan = _new_plan(model)
    if plan is None or not values.keys() <= plan.names:
        return model(**values)
    row = model.__new__(model)
    row._state = ModelState()
    fields = row.__dict__
    for attname, name, default, relation in plan.fields:
        if relation is not None and name in values:
            related = values[name]
            target, reverse = relation
            fields[attname] = None if related is None else getattr(related, target)
            attach_related(row, name, related)
            if reverse is not None and related is not None:
                reverse.set_cached_value(related, row)
        elif attname in values:
            fields[attname] = values[attname]
        else:
            fields[attname] = default()
    return row


@dataclass(frozen=True)
class _NewPlan:
    # Per concrete field: attname, name, default, and for a relation (its target's attname,
    # the remote field of a one-to-one, whose cache on the related row is set too).
    fields: list[tuple[str, str, Callable[[], Any], tuple[str, Any] | None]]
    names: frozenset[str]


@cache
def _new_plan(model: type[Model]) -> _NewPlan | None:
    if signals.pre_init.has_listeners(model) or signals.post_init.has_listeners(model):
        return None
    fields = []
    names: set[str] = set()
    for f in model._meta.concrete_fields:
        relation = None
        if f.is_relation:
            if f.primary_key or len(f.related_fields) != 1:
                return None  # a parent link, or a composite key: Model.__init__'s own way
            relation = (f.related_fields[0][1].attname, None if f.remote_field.multiple else f.remote_field)
        fields.append((f.attname, f.name, f._get_default, relation))
        names |= {f.attname, f.name}
    return _NewPlan(fields, frozenset(names))


def fetch(sql: str, params: list[Any] | dict[str, Any], *, async_commit: bool = False) -> list[tuple[Any, ...]]:
    """Run one of the hot paths' fixed statements (the claims, the attempt rows, the marks)
    and fetch its rows, through Django's cursor with its parameters bound server-side and, on a
    direct connection, the statement prepared on its first run in each connection
    (project/postgresql `prepared_cursor`). `async_commit`: see `_execute`."""
    return _execute(connections[DEFAULT_DB_ALIAS], sql, params, async_commit=async_commit)[0]


def execute(sql: str, params: list[Any] | dict[str, Any], *, async_commit: bool = False) -> int:
    """`fetch` for a statement without rows: how many rows it changed."""
    return _execute(connections[DEFAULT_DB_ALIAS], sql, params, rows=False, async_commit=async_commit)[1]


# A statement and its parameters, run before another in its transaction (`_execute`'s `before`).
Statement = tuple[str, list[Any]]

# Set for the statement's own transaction only (is_local): PostgreSQL reverts it at the commit.
_ASYNC_COMMIT_SQL = "SELECT set_config('synchronous_commit', 'off', true)"


def _execute(
    db: Any,
    sql: str,
    params: list[Any] | dict[str, Any],
    *,
    rows: bool = True,
    async_commit: bool = False,
    lists_as_text: bool = True,
    before: Statement | None = None,
) -> tuple[list[tuple[Any, ...]], int]:
    """Run one statement on Django's prepared cursor (`prepared_cursor`): (its rows, its row
    count).

    `async_commit`: run on its own, the statement commits without waiting for the disk; for a
    write that is redone when lost, since a later synchronous commit (the attempt row before any
    request) has it on disk first. `lists_as_text`: lists of ints or bools go as array text.
    `before`: a statement run first in the same transaction and round trip (a lock the
    statement's reads must come after). The statements run first are not in Django's query
    log; the statement's text there (and as sent) says they ran. Why: docs/DESIGN.md."""
    if lists_as_text and isinstance(params, dict):
        params = {k: _array_text(v) for k, v in params.items()}
    elif lists_as_text:
        params = [_array_text(v) for v in params]
    with db.prepared_cursor(fast_times=rows) as cursor:
        commit_async = async_commit and db.get_autocommit() and not db.in_atomic_block
        if commit_async or before is not None:
            # One round trip: the statements first, then this one, as one entry in the query log.
            db.validate_no_broken_transaction()
            with db.wrap_database_errors, db.connection.pipeline():
                if commit_async:
                    db.connection.execute(_ASYNC_COMMIT_SQL, prepare=True)
                if before is not None:
                    db.connection.execute(before[0], [_array_text(v) for v in before[1]], prepare=True)
                    sql = _noted(sql, f"after {before[0]}")
                cursor.execute(_noted(sql, "async commit") if commit_async else sql, params)
        else:
            cursor.execute(sql, params)
        return (cursor.fetchall() if rows else []), cursor.rowcount


@cache
def _noted(sql: str, note: str) -> str:
    """`sql` with a comment that names what ran before it in its round trip; a % in the note
    escaped, so that the comment takes no parameter."""
    return f"{sql} /* {note.replace('%', '%%')} */"


def _array_text(value: Any) -> Any:
    """A list of ints or of bools (the hot paths' ids, flags) as PostgreSQL's text for an
    array, which its statement casts (`%s::bigint[]`) or compares (`= ANY(%s)`): psycopg dumps a
    list element by element in Python, far slower than this. Anything else goes to psycopg as it
    is (a list of texts needs quoting)."""
    if type(value) is not list:
        return value
    if all(type(v) is int or v is None for v in value):
        return "{" + ",".join("NULL" if v is None else str(v) for v in value) + "}"
    if value and all(type(v) is bool for v in value):
        return "{" + ",".join("t" if v else "f" for v in value) + "}"
    return value


def insert_once(
    row: Model, *, unique: tuple[str, ...], async_commit: bool = False, before: Statement | None = None
) -> bool:
    """Insert `row` unless a row with the same `unique` columns exists. True: inserted, and
    `row` is saved (its pk set). False: nothing was written. `async_commit`, `before`: see
    `_execute`."""
    model = type(row)
    db = connections[DEFAULT_DB_ALIAS]  # the thread's own wrapper: no proxy lookup per field
    params = [f.get_db_prep_save(f.pre_save(row, True), db) for f in _fields(model)]
    sql = _sql(model, unique)
    inserted = _execute(db, sql, params, async_commit=async_commit, lists_as_text=False, before=before)[0]
    if not inserted:
        return False
    row.pk = inserted[0][0]
    row._state.adding, row._state.db = False, db.alias
    return True


class JSONText(str):
    """A JSON field's value already encoded (the webhook's body, as it came): inserted as it
    is, PostgreSQL parsing it, instead of decoded and encoded again."""


def insert_values_once(model: type[Model], values: dict[str, Any], *, unique: tuple[str, ...]) -> int | None:
    """insert_once for a row given as {attname: value}, without a model instance: the new
    row's pk, or None when a row with the same `unique` columns exists. The values go to
    psycopg as they are, so each must already be what its field stores (an int,
    a str, an aware datetime, None; for a JSON field any value json.dumps takes, or a
    JSONText), which spares the hot path Django's per-field conversions (~a third of the
    webhook's CPU with the model's __init__). A field left out takes its default, which must
    be a constant."""
    db = connections[DEFAULT_DB_ALIAS]
    params = []
    for attname, encode, default in _value_plan(model):
        if attname not in values:
            if default is _REQUIRED:
                raise TypeError(f"insert_values_once({model.__name__}): {attname} has no constant default; give it")
            params.append(default)
            continue
        value = values[attname]
        params.append(value if encode is None or isinstance(value, JSONText) or value is None else encode(value))
    inserted = _execute(db, _sql(model, unique), params, lists_as_text=False)[0]
    return inserted[0][0] if inserted else None


_REQUIRED = object()


@cache
def _value_plan(model: type[Model]) -> list[tuple[str, Callable[[Any], str] | None, Any]]:
    """(attname, a JSON field's encoding or None, the default's database value or _REQUIRED)
    per column of `_sql`: a callable default, auto_now and auto_now_add are the caller's to
    give."""
    plan = []
    for f in _fields(model):
        constant = not _set_on_save(f) and not (f.has_default() and callable(f.default))
        default = f.get_db_prep_save(f.get_default(), connection) if constant else _REQUIRED
        encode = partial(json.dumps, cls=f.encoder) if isinstance(f, JSONField) else None
        plan.append((f.attname, encode, default))
    return plan


def insert_many_once(
    rows: list[Model], *, unique: tuple[str, ...], async_commit: bool = False, before: Statement | None = None
) -> int:
    """insert_once for several rows of one model in one statement. Each row inserted gets
    its pk; a row whose `unique` columns were taken keeps pk None. Returns how many were
    inserted. `unique` names columns (e.g. "update_id"); `async_commit`, `before`: see
    `_execute`."""
    if not rows:
        return 0
    model = type(rows[0])
    db = connections[DEFAULT_DB_ALIAS]
    sql = _sql_columns(model, unique)
    fetched = _execute(db, sql, [_rows_json(rows)], async_commit=async_commit, before=before)[0]
    return _saved(db, rows, unique, fetched)


def insert_many_computed(
    rows: list[Model],
    *,
    unique: tuple[str, ...],
    computed: dict[str, str],
    lateral: str = "",
    returning: str = "",
    params: dict[str, Any] | None = None,
    async_commit: bool = False,
    before: Statement | None = None,
) -> list[tuple[Any, ...] | None]:
    """`insert_many_once` with some columns decided by the statement itself:
    each row's values are `r` (the table's row type, from their JSON; `r.ordinality` is its
    place in `rows` from 1, for a parameter array indexed by row), `lateral` a LATERAL
    subquery beside it (as `x`), and `computed` gives {column: SQL over r and x};
    `returning` adds expressions to the pk. Parameters are named (%(name)s, in `params`;
    `row` is taken). Each row inserted gets its pk; its other fields are the caller's to
    update from `returning`. Returns, per row in order, (pk, *returning), or None where its
    `unique` columns were taken. `async_commit`, `before`: see `_execute`."""
    if not rows:
        return []
    model = type(rows[0])
    db = connections[DEFAULT_DB_ALIAS]
    sql = _sql_computed(model, unique, tuple(computed.items()), lateral, returning)
    values = {**(params or {}), "row": _rows_json(rows)}
    fetched = _execute(db, sql, values, async_commit=async_commit, before=before)[0]
    by_key = {tuple(found[1 : 1 + len(unique)]): (found[0], *found[1 + len(unique) :]) for found in fetched}
    _saved(db, rows, unique, [found[: 1 + len(unique)] for found in fetched])
    return [by_key.pop(_unique_values(db, row, unique), None) for row in rows]  # first with a key, as _saved


def insert_fanned_out(
    template: Model, *, unique: tuple[str, ...], varying: dict[str, list[Any]]
) -> list[tuple[Any, ...]]:
    """PostgreSQL: one row per element of `varying`'s lists ({column: values}, all of one
    length), each the `template` but for those columns, in one statement whose size is the
    template once and the varying values (a broadcast's 10,000 messages: one payload, 10,000
    chats and keys), where `insert_many_once` would repeat every column of every row. Rows
    whose `unique` columns are taken are skipped. Returns (pk, *unique) of the rows written."""
    model = type(template)
    columns = tuple(varying)
    count = len(next(iter(varying.values()))) if varying else 0
    values = [dict(zip(columns, row, strict=True)) for row in zip(*varying.values(), strict=True)]
    if not count:
        return []
    sql = _sql_fanned_out(model, unique, columns)
    db = connections[DEFAULT_DB_ALIAS]
    return _execute(db, sql, [_rows_json([template]), orjson.dumps(values).decode()])[0]


@cache
def _sql_fanned_out(model: type[Model], unique: tuple[str, ...], varying: tuple[str, ...]) -> str:
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    select = ", ".join(("v." if f.column in varying else "r.") + qn(f.column) for f in _fields(model))
    source = (
        f"SELECT {select} FROM json_populate_recordset(NULL::{table}, %s::json) r,"  # noqa: S608 - names from _meta
        f" json_populate_recordset(NULL::{table}, %s::json) v"
    )
    return _insert(model, unique, source)


@cache
def _sql_computed(
    model: type[Model], unique: tuple[str, ...], computed: tuple[tuple[str, str], ...], lateral: str, returning: str
) -> str:
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    by_column = dict(computed)
    select = ", ".join(by_column.get(f.column, "r." + qn(f.column)) for f in _fields(model))
    beside = f", LATERAL ({lateral}) x" if lateral else ""
    keys = ", ".join(qn(c) for c in unique)
    return (
        f"INSERT INTO {table} ({_columns(model)}) SELECT {select}"  # noqa: S608 - names from _meta
        f" FROM json_populate_recordset(NULL::{table}, %(row)s::json) WITH ORDINALITY r{beside}"
        f" ON CONFLICT ({keys}) DO NOTHING"
        f" RETURNING {qn(model._meta.pk.column)}, {keys}{', ' + returning if returning else ''}"
    )


def insert_many_with(
    rows: list[Model],
    *,
    unique: tuple[str, ...],
    mark: str,
    mark_params: list[Any],
    of: str,
    async_commit: bool = False,
) -> set[int]:
    """PostgreSQL: `mark` (an UPDATE … RETURNING id) and the insert of those `rows` whose
    column `of` holds one of the ids it returned, in one statement: the rows of a parent
    that this statement moved on are written with that move, atomically, in one round trip,
    and those of a parent that someone else moved first are not written at all. Returns the
    ids `mark` returned; each row inserted gets its pk (`insert_many_once`). `async_commit`:
    see `_execute`."""
    db = connections[DEFAULT_DB_ALIAS]
    model = type(rows[0]) if rows else None
    if model is None:
        return {marked for marked, *_ in _execute(db, mark, mark_params, async_commit=async_commit)[0]}
    sql, params = _sql_with(model, unique, mark, of), [*mark_params, _rows_json(rows)]
    fetched = _execute(db, sql, params, async_commit=async_commit)[0]
    _saved(db, rows, unique, [row[1:] for row in fetched if row[1] is not None])
    return {row[0] for row in fetched}


@cache
def _sql_with(model: type[Model], unique: tuple[str, ...], mark: str, of: str) -> str:
    of = connection.ops.quote_name(of)
    source = f"{_rows_source(model, 'v.')} AS v WHERE v.{of} IN (SELECT id FROM marked)"  # noqa: S608 - names from _meta
    return (
        f"WITH marked AS ({mark}), inserted AS ({_insert(model, unique, source)}) "  # noqa: S608 - the caller's SQL
        f"SELECT marked.id, inserted.* FROM marked LEFT JOIN inserted ON inserted.{of} = marked.id"
    )


def _unique_values(db: Any, row: Model, unique: tuple[str, ...]) -> tuple[Any, ...]:
    """The row's `unique` columns as the database returns them."""
    by_column = _by_column(type(row))
    return tuple(by_column[c].get_db_prep_save(getattr(row, by_column[c].attname), db) for c in unique)


@cache
def _by_column(model: type[Model]) -> dict[str, Any]:
    return {f.column: f for f in _fields(model)}


def _saved(db: Any, rows: list[Model], unique: tuple[str, ...], fetched: list[tuple[Any, ...]]) -> int:
    """Give each inserted row its pk from (pk, *unique) rows; how many were inserted. A row
    whose key an earlier row of the same statement took was not inserted (ON CONFLICT): only
    the first row with a key gets its pk."""
    inserted = {tuple(values): pk for pk, *values in fetched}
    count = len(inserted)
    for row in rows:
        pk = inserted.pop(_unique_values(db, row, unique), None)
        if pk is not None:
            row.pk = pk
            row._state.adding, row._state.db = False, db.alias
    return count
