"""The PostgreSQL backend's CPU for the hot path's row writes, in one connection, with the
trace ids' `varchar_pattern_ops` twin indexes (as before bots.0009 and outbox.0009) and
without them (as now), taking turns:

    .venv/bin/python bench/row_writes.py [--batches 100] [--rounds 2]

Each batch writes 50 updates the way the hot path does, as plain SQL: their insert, the
routing mark (new -> done), two consumer runs each written running, and the runs' done mark.
The figures are the backend's CPU per update for each statement, in µs, read from its
/proc/<pid>/schedstat (PostgreSQL must run on this host); the tables are emptied before each
measurement. Creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics

import _common as c

DB = "dovecote_bench_row_writes"
BATCH = 50
TWINS = [
    ("bots_inboundupdate", "inbox_trace_idx"),
    ("bots_consumerrun", "run_trace_idx"),
    ("outbox_outboundmessage", "outbox_trace_idx"),
]
STEPS = ("the update's insert", "the routing mark", "two runs' insert", "their done mark")


def measure(cursor, pid: int, bot_id: int, batches: int, first: int) -> list[float]:
    """µs of backend CPU per update for each of STEPS."""

    spent = [0.0] * len(STEPS)
    statements = [
        """INSERT INTO bots_inboundupdate (bot_id, update_id, update_type, chat_id, chat_type, user_id, message_id,
             payload, state, attempts, next_attempt_at, lease_owner, trace_id, last_error, received_at)
           SELECT %(bot)s, g, 'message', g %% 200, 'private', g, g,
             jsonb_build_object('update_id', g, 'text', repeat('x', 800)), 'new', 0, now(), '', md5(g::text), '', now()
           FROM generate_series(%(first)s, %(last)s) g""",
        """WITH picked AS MATERIALIZED (SELECT id FROM bots_inboundupdate WHERE bot_id = %(bot)s AND state = 'new'
             ORDER BY id LIMIT 50 FOR UPDATE SKIP LOCKED)
           UPDATE bots_inboundupdate u SET state = 'done', processed_at = now(), attempts = u.attempts + 1
           FROM picked WHERE u.id = picked.id""",
        """INSERT INTO bots_consumerrun (update_id, bot_id, consumer, state, attempts, max_attempts, next_attempt_at,
             lease_owner, lease_expires_at, last_error, last_error_class, cancel_reason, outcome, trace_id,
             created_at, updated_at)
           SELECT u.id, u.bot_id, k, 'running', 1, 5, now(), 'w', now() + interval '1 minute', '', '', '', '',
             u.trace_id, now(), now()
           FROM bots_inboundupdate u, unnest(ARRAY['auto_reply', 'analytics']) k
           WHERE u.bot_id = %(bot)s AND u.update_id BETWEEN %(first)s AND %(last)s""",
        "UPDATE bots_consumerrun SET state = 'done', finished_at = now(), updated_at = now() WHERE state = 'running'",
    ]
    for n in range(batches):
        params = {"bot": bot_id, "first": first + n * BATCH, "last": first + n * BATCH + BATCH - 1}
        for i, sql in enumerate(statements):
            started = c.backend_cpu_us(pid)
            cursor.execute(sql, params)
            spent[i] += c.backend_cpu_us(pid) - started
    return [s / batches / BATCH for s in spent]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with c.database_with_bot(DB, "row-writes", "700004:row-writes-bench") as bot:
        from django.db import connection

        cursor = connection.cursor()
        pid = connection.connection.info.backend_pid
        results: dict[str, list[list[float]]] = {"with the twins": [], "without (now)": []}
        first = 0
        for _ in range(args.rounds):
            for variant in results:
                for table, index in TWINS:
                    if variant == "with the twins":
                        cursor.execute(f"CREATE INDEX {index}_like ON {table} (trace_id varchar_pattern_ops)")
                    else:
                        cursor.execute(f"DROP INDEX IF EXISTS {index}_like")
                # Fresh tables for each measurement: without autovacuum here, the dead row
                # versions of the runs before would slow the later ones.
                cursor.execute("TRUNCATE bots_consumerrun, bots_inboundupdate CASCADE")
                results[variant].append(measure(cursor, pid, bot.pk, args.batches, first))
                first += args.batches * BATCH
        print(f"backend CPU per update, µs ({args.rounds} rounds of {args.batches} batches of {BATCH}, in turns)")
        print("| statement | " + " | ".join(results) + " |")
        print("|---|" + "---|" * len(results))
        for i, step in enumerate(STEPS):
            cells = [" / ".join(f"{r[i]:.1f}" for r in runs) for runs in results.values()]
            print(f"| {step} | " + " | ".join(cells) + " |")
        totals = {v: statistics.median(sum(r) for r in runs) for v, runs in results.items()}
        print("median of the four together: " + ", ".join(f"{v} {t:.1f}" for v, t in totals.items()))


if __name__ == "__main__":
    main()
