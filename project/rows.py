"""Inserting a row once, in one statement: the hot paths' `INSERT … ON CONFLICT DO NOTHING`
(the webhook's update, a one-message enqueue). PostgreSQL (and SQLite 3.35+); no SELECT first,
no savepoint."""

from __future__ import annotations

from functools import cache
from typing import Any

from django.db import connection
from django.db.models import Model


@cache
def _fields(model: type[Model]) -> list[Any]:
    return [f for f in model._meta.concrete_fields if not f.primary_key]


@cache
def _sql(model: type[Model], unique: tuple[str, ...]) -> str:
    qn = connection.ops.quote_name
    meta = model._meta
    columns = ", ".join(qn(f.column) for f in _fields(model))
    placeholders = ", ".join(["%s"] * len(_fields(model)))
    return (
        f"INSERT INTO {qn(meta.db_table)} ({columns}) VALUES ({placeholders}) "  # noqa: S608 - names from _meta
        f"ON CONFLICT ({', '.join(qn(c) for c in unique)}) DO NOTHING RETURNING {qn(meta.pk.column)}"
    )


def insert_once(row: Model, *, unique: tuple[str, ...]) -> bool:
    """Insert `row` unless a row with the same `unique` columns exists. True: inserted, and
    `row` is saved (its pk set). False: nothing was written."""
    model = type(row)
    params = [f.get_db_prep_save(f.pre_save(row, True), connection) for f in _fields(model)]
    with connection.cursor() as cursor:
        cursor.execute(_sql(model, unique), params)
        inserted = cursor.fetchone()
    if inserted is None:
        return False
    row.pk = inserted[0]
    row._state.adding, row._state.db = False, connection.alias
    return True
