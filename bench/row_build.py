"""The Python CPU of the hot path's rows on the worker's side: each new row (a consumer run,
a reply, its attempt, an analytics event) built with Model.__init__ and with core/rows.py's
`new`; a reply's row made from an enqueue's arguments, its checks included (outbox/services.py
`_prepared`); a batch's rows encoded as the JSON of their one insert, by json and by
`rows._rows_json` (orjson); timestamptz values read through a Django cursor and through the hot path's
own statements (`rows.fetch`, psycopg's C loader); and lists of ids and flags bound to a
statement as psycopg dumps them and as the text `rows._execute` binds instead:

    .venv/bin/python bench/row_build.py [--rows 20000] [--rounds 5]

Prints the best of `--rounds` for each, in µs per row (per value for the timestamps). Needs
PostgreSQL on 127.0.0.1 (the `postgres` database, read only: nothing is written).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import _common as c

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--rows", type=int, default=20000, help="rows built (values read) per round")
parser.add_argument("--rounds", type=int, default=5, help="rounds; the best is printed")


def best_us(rounds: int, count: int, work: Callable[[], Any]) -> float:
    spent = []
    for _ in range(rounds):
        started = time.process_time()
        work()
        spent.append(time.process_time() - started)
    return min(spent) / count * 1e6


def main() -> None:
    args = parser.parse_args()
    c.django_setup(c.bench_env("postgres"))
    from django.db import connection
    from django.utils import timezone

    from bots.models import AnalyticsEvent, ConsumerRun, InboundUpdate
    from core import rows
    from outbox.models import Attempt, OutboundMessage

    now = timezone.now()
    update = InboundUpdate(pk=1, bot_id=1, update_id=1, trace_id="0" * 32, received_at=now, next_attempt_at=now)
    message = OutboundMessage(pk=1, bot_id=1, chat_id=1)
    # The values the hot path gives each row (bots/routing.py _route, outbox/services.py
    # _prepared, outbox/transitions.py begin_attempts, bots/consumers.py analytics_event).
    hot_rows: list[tuple[type, dict[str, Any]]] = [
        (
            ConsumerRun,
            {
                "update": update,
                "bot_id": 1,
                "consumer": "auto_reply",
                "max_attempts": 5,
                "next_attempt_at": now,
                "trace_id": update.trace_id,
                "state": "running",
                "lease_owner": "worker-1",
                "lease_expires_at": now,
                "attempts": 1,
            },
        ),
        (
            OutboundMessage,
            {
                "bot_id": 1,
                "idempotency_key": "upd:1:auto_reply:0",
                "request_fingerprint": "f" * 64,
                "chat_id": 1,
                "method": "sendMessage",
                "payload": {"text": "hello"},
                "trace_id": update.trace_id,
                "source_update_id": 1,
                "consumer": "auto_reply",
                "user_id": 1,
                "send_at": None,
                "expires_at": None,
                "on_ambiguous": "hold",
                "ordered": True,
                "max_attempts": 8,
                "next_attempt_at": now,
            },
        ),
        (Attempt, {"id": 1, "message": message, "number": 1, "worker": "worker-1", "started_at": now}),
        (
            AnalyticsEvent,
            {
                "bot_id": 1,
                "update": update,
                "update_type": "message",
                "chat_id": 1,
                "chat_type": "private",
                "user_id": 1,
                "message_date": now,
                "received_at": now,
                "latency_ms": 1,
            },
        ),
    ]
    n = args.rows
    print(f"building a row, µs (best of {args.rounds} rounds of {n:,}):")
    print("  row               Model.__init__   rows.new   ratio")
    for model, values in hot_rows:
        init = best_us(args.rounds, n, lambda model=model, values=values: [model(**values) for _ in range(n)])
        new = best_us(args.rounds, n, lambda model=model, values=values: [rows.new(model, **values) for _ in range(n)])
        print(f"  {model.__name__:<16} {init:>14.2f} {new:>10.2f} {new / init:>7.2f}")

    import json

    print(f"a batch's rows as the JSON of their one insert, µs per row (best of {args.rounds} rounds of {n:,}):")
    print("  row               json.dumps   rows._rows_json   ratio")
    for model, values in hot_rows[:2] + hot_rows[3:]:  # the attempt is not written this way
        batch = [rows.new(model, **values) for _ in range(50)]

        def as_json(batch: list[Any] = batch) -> str:
            fields = rows._fields(type(batch[0]))
            objects = [{f.column: vars(row)[f.attname] for f in fields} for row in batch]
            return json.dumps(objects, default=rows._json_value, allow_nan=False)

        encoded = rows._rows_json(batch)  # first: it sets the auto_now fields
        assert json.loads(as_json()) == json.loads(encoded)
        before = best_us(args.rounds, n, lambda as_json=as_json: [as_json() for _ in range(n // 50)])
        after = best_us(args.rounds, n, lambda batch=batch: [rows._rows_json(batch) for _ in range(n // 50)])
        print(f"  {model.__name__:<16} {before:>11.2f} {after:>17.2f} {after / before:>7.2f}")

    from outbox.services import _prepared

    reply = {
        "bot_id": 1,
        "chat_id": 1,
        "payload": {"text": "an echo of a message of some length, " * 5},
        "idempotency_key": "upd:1:auto_reply:0",
        "trace_id": update.trace_id,
        "source_update_id": 1,
        "consumer": "auto_reply",
        "user_id": 1,
    }
    made = best_us(args.rounds, n, lambda: [_prepared(**reply) for _ in range(n)])
    print(f"a reply's row made from an enqueue's arguments (checks, split, fingerprint, row), µs: {made:.2f}")

    sql = "SELECT now() - g * interval '1 second', now(), now(), now(), now() FROM generate_series(1, %s) g"
    per = n // 5

    def through_django() -> None:
        with connection.cursor() as cursor:
            cursor.execute(sql, [per])
            cursor.fetchall()

    django = best_us(args.rounds, per * 5, through_django)
    hot = best_us(args.rounds, per * 5, lambda: rows.fetch(sql, [per]))
    print(f"reading a timestamptz value, µs (best of {args.rounds} rounds of {per * 5:,}, the fetch included):")
    print(f"  a Django cursor {django:.2f}, rows.fetch {hot:.2f}, ratio {hot / django:.2f}")

    import psycopg

    print(f"binding lists to a statement, µs per statement (best of {args.rounds} rounds of {n // 10:,}):")
    print("  lists                      psycopg's   as text   ratio")
    bind = "SELECT cardinality(%s::bigint[]), cardinality(%s::bigint[]), cardinality(%s::boolean[])"
    for label, lists in [
        ("three of 1 (a lone update)", [[10**12], [10**12 + 1], [True]]),
        ("three of 50 (a batch)", [list(range(10**12, 10**12 + 50))] * 2 + [[True] * 50]),
    ]:

        def run(params: list[Any]) -> None:
            with psycopg.Cursor(connection.connection) as cursor:
                for _ in range(n // 10):
                    cursor.execute(bind, params, prepare=True)
                    cursor.fetchall()

        as_lists = best_us(args.rounds, n // 10, lambda lists=lists: run(lists))
        as_text = best_us(args.rounds, n // 10, lambda lists=lists: run([rows._array_text(v) for v in lists]))
        print(f"  {label:<26} {as_lists:>9.1f} {as_text:>9.1f} {as_text / as_lists:>7.2f}")


if __name__ == "__main__":
    main()
