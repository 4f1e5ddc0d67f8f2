"""Tables as a deployed bot has filled them, for the benches that measure writes at scale
(bench/trace_ids.py, bench/hotpath_cpu.py --prefill): updates over many chats, two consumer
runs and one sent reply each, written with random trace ids (as before time-ordered ones),
then vacuumed and analyzed. Plain SQL, ~2 min for 1 M updates."""

from __future__ import annotations

import time
from typing import Any

# A deployed bot's chats: each is one insertion point in the per-chat indexes.
CHATS = 5000

_STATEMENTS = [
    """INSERT INTO bots_inboundupdate (bot_id, update_id, update_type, chat_id, chat_type, user_id, message_id,
         payload, state, attempts, next_attempt_at, trace_id, last_error, received_at, processed_at)
       SELECT %(bot)s, g, 'message', 100000 + g * 7919 %% %(chats)s, 'private', 100000 + g * 7919 %% %(chats)s, g,
         jsonb_build_object('update_id', g, 'message', jsonb_build_object('message_id', g,
           'chat', jsonb_build_object('id', 100000 + g * 7919 %% %(chats)s, 'type', 'private'),
           'text', repeat('lorem ipsum ', 60))),
         'done', 1, now(), md5(random()::text), '', now() - interval '30 days' + g * interval '1 second', now()
       FROM generate_series(1::bigint, %(rows)s) g""",
    """INSERT INTO bots_consumerrun (update_id, bot_id, consumer, state, attempts, max_attempts, next_attempt_at,
         lease_owner, last_error, last_error_class, cancel_reason, outcome, trace_id, created_at, updated_at,
         finished_at)
       SELECT u.id, u.bot_id, k, 'done', 1, 5, u.received_at, '', '', '', '', 'done', u.trace_id, u.received_at,
         u.received_at, u.received_at
       FROM bots_inboundupdate u, unnest(ARRAY['analytics', 'auto_reply']) k ORDER BY u.id, k""",
    """INSERT INTO outbox_outboundmessage (bot_id, chat_id, method, payload, idempotency_key, request_fingerprint,
         trace_id, source_update_id, consumer, broadcast, state, ordered, attempts, max_attempts,
         rate_limited_count, next_attempt_at, lease_owner, on_ambiguous, last_error, last_error_class,
         cancel_reason, telegram_message_id, created_at, updated_at, sent_at)
       SELECT u.bot_id, u.chat_id, 'sendMessage', jsonb_build_object('chat_id', u.chat_id, 'text', 'Echo: hi'),
         'chat:' || u.chat_id || ':auto_reply:upto:' || u.message_id, '', u.trace_id, u.id, 'auto_reply', '',
         'sent', true, 1, 8, 0, u.received_at, '', 'hold', '', '', '', u.id, u.received_at, u.received_at,
         u.received_at
       FROM bots_inboundupdate u ORDER BY u.id""",
]


def deployed_tables(cursor: Any, *, bot_id: int, rows: int, chats: int = CHATS) -> str:
    """Fill the empty tables through `cursor` (autocommit); says what it wrote."""
    started = time.monotonic()
    for sql in _STATEMENTS:
        cursor.execute(sql, {"bot": bot_id, "rows": rows, "chats": chats})
    cursor.execute("VACUUM ANALYZE")
    took = time.monotonic() - started
    return f"{rows:,} updates over {chats:,} chats, {2 * rows:,} runs, {rows:,} replies written ({took:.0f} s)"
