"""The hot path's row writes on tables a deployed bot has filled, with random trace ids (as
before) and with time-ordered ones (core/ids.py, now), taking turns:

    .venv/bin/python bench/trace_ids.py [--rows 1000000] [--batches 100] [--rounds 2]

The tables start with `--rows` updates over 5,000 chats, two consumer runs and one reply
each, written with random trace ids as a bot that ran before this change has them, then
analyzed (~3 min for 1 M). Each measurement starts with a CHECKPOINT (PostgreSQL makes one
every few minutes), then writes `--batches` batches of 50 updates as the hot path does, as
plain SQL: each update's insert on its own with a synchronous commit (the webhook), then for
the batch, in one transaction with an asynchronous commit (the router's): the routing mark,
two consumer runs per update, their done mark, and one reply per update carrying the
update's trace id. Printed per update: the PostgreSQL backend's CPU (its
/proc/<pid>/schedstat: PostgreSQL must run on this host) and the WAL written
(pg_current_wal_lsn). Creates and drops its own database.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import _common as c
import prefill

DB = "dovecote_bench_trace_ids"
BATCH = 50

INSERT_UPDATE = """INSERT INTO bots_inboundupdate (bot_id, update_id, update_type, chat_id, chat_type, user_id,
     message_id, payload, state, attempts, next_attempt_at, trace_id, last_error, received_at)
   VALUES (%s, %s, 'message', %s, 'private', %s, %s, %s, 'new', 0, now(), %s, '', now())
   ON CONFLICT (bot_id, update_id) DO NOTHING RETURNING id"""

ROUTE = [
    "SELECT set_config('synchronous_commit', 'off', true)",
    """UPDATE bots_inboundupdate SET state = 'done', processed_at = now(), attempts = attempts + 1
       WHERE id = ANY(%(ids)s)""",
    """INSERT INTO bots_consumerrun (update_id, bot_id, consumer, state, attempts, max_attempts, next_attempt_at,
         lease_owner, lease_expires_at, last_error, last_error_class, cancel_reason, outcome, trace_id,
         created_at, updated_at)
       SELECT u.id, u.bot_id, k, 'running', 1, 5, now(), 'w', now() + interval '1 minute', '', '', '', '',
         u.trace_id, now(), now()
       FROM bots_inboundupdate u, unnest(ARRAY['analytics', 'auto_reply']) k WHERE u.id = ANY(%(ids)s)""",
    """UPDATE bots_consumerrun SET state = 'done', outcome = 'done', finished_at = now(), updated_at = now()
       WHERE update_id = ANY(%(ids)s)""",
    """INSERT INTO outbox_outboundmessage (bot_id, chat_id, method, payload, idempotency_key, request_fingerprint,
         trace_id, source_update_id, consumer, broadcast, state, ordered, attempts, max_attempts,
         rate_limited_count, next_attempt_at, lease_owner, on_ambiguous, last_error, last_error_class,
         cancel_reason, created_at, updated_at)
       SELECT u.bot_id, u.chat_id, 'sendMessage', jsonb_build_object('chat_id', u.chat_id, 'text', 'Echo: hi'),
         'chat:' || u.chat_id || ':auto_reply:upto:' || u.message_id, '', u.trace_id, u.id, 'auto_reply', '',
         'pending', true, 0, 8, 0, now(), '', 'hold', '', '', '', now(), now()
       FROM bots_inboundupdate u WHERE u.id = ANY(%(ids)s)""",
]


def measure(cursor, pid: int, bot_id: int, batches: int, first: int, new_id) -> tuple[float, float]:
    """(µs of backend CPU, KiB of WAL) per update, over `batches` batches after a checkpoint."""

    def wal() -> int:
        cursor.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
        return int(cursor.fetchone()[0])

    cursor.execute("CHECKPOINT")
    started_cpu, started_wal = c.backend_cpu_us(pid), wal()
    for n in range(batches):
        ids = []
        for update_id in range(first + n * BATCH, first + (n + 1) * BATCH):
            chat = 100000 + random.randrange(prefill.CHATS)
            payload = json.dumps({"update_id": update_id, "message": {"message_id": update_id, "text": "hi" * 300}})
            cursor.execute(INSERT_UPDATE, [bot_id, update_id, chat, chat, update_id, payload, new_id()])
            ids.append(cursor.fetchone()[0])
        cursor.execute("BEGIN")
        for sql in ROUTE:
            cursor.execute(sql, {"ids": ids})
        cursor.execute("COMMIT")
    updates = batches * BATCH
    return (c.backend_cpu_us(pid) - started_cpu) / updates, (wal() - started_wal) / updates / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", type=int, default=1_000_000, help="updates already stored (each with 2 runs, 1 reply)"
    )
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with c.database_with_bot(DB, "trace-ids", "700005:trace-ids-bench") as bot:
        import psycopg

        from core.ids import random_id, time_ordered_id

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{DB}", autocommit=True) as conn:
            cursor = conn.cursor()
            print(prefill.deployed_tables(cursor, bot_id=bot.pk, rows=args.rows))
            variants = {"random (before)": random_id, "time-ordered (now)": time_ordered_id}
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
            first = args.rows + 1
            for _ in range(args.rounds):
                for name, new_id in variants.items():
                    results[name].append(measure(cursor, conn.info.backend_pid, bot.pk, args.batches, first, new_id))
                    first += args.batches * BATCH
    print(f"per update, after a checkpoint ({args.rounds} rounds of {args.batches} batches of {BATCH}, in turns)")
    print("| trace ids | backend CPU, µs | WAL, KiB |")
    print("|---|---|---|")
    for name, runs in results.items():
        cpu = " / ".join(f"{r[0]:.0f}" for r in runs)
        wal = " / ".join(f"{r[1]:.1f}" for r in runs)
        print(
            f"| {name} | {cpu} (median {statistics.median(r[0] for r in runs):.0f}) "
            f"| {wal} (median {statistics.median(r[1] for r in runs):.1f}) |"
        )


if __name__ == "__main__":
    main()
