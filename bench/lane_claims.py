"""A drain's claim while a big broadcast waits: one bot's broadcast of `--chats` messages due
(the bulk lane), another bot's ten replies due (the replies' lane); the median time of each
lane's claim (`transitions.claim_batch`, 8 at a time) with each lane's index, then with the
replies' index dropped (the claim then walks outbox_due_idx past every due broadcast
message). Not a test: figures go to docs/PERFORMANCE.md.

    .venv/bin/python bench/lane_claims.py [--chats 20000] [--rounds 20]

Needs PostgreSQL and Redis on 127.0.0.1; creates and drops its own database.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import _common as c

DB = f"dovecote_lane_claims_{os.getpid()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    env = c.bench_env(DB)
    c.setup_database(DB, env)
    try:
        c.django_setup(env)
        from django.db import connection
        from django.utils import timezone

        from bots.models import Bot
        from outbox import services, transitions
        from outbox.models import OutboundMessage, State

        sender = Bot.objects.create(name="sender", token="200011:sender-token-abcdefghijklmnopqrstuvwxyz")
        other = Bot.objects.create(name="other", token="200012:other-token-abcdefghijklmnopqrstuvwxyz")
        services.broadcast_enqueue(
            bot_id=sender.pk, chat_ids=list(range(1, args.chats + 1)), payload={"text": "sale"}, broadcast_key="sale"
        )
        OutboundMessage.objects.filter(bot=sender).update(next_attempt_at=timezone.now() - timedelta(minutes=1))
        for n in range(10):
            OutboundMessage.objects.create(
                bot=other,
                chat_id=n,
                payload={"text": "hi"},
                idempotency_key=f"reply{n}",
                next_attempt_at=timezone.now(),
            )

        def median_claim_ms(bot, *, bulk: bool) -> float:
            times = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                got = transitions.claim_batch(
                    bot_id=bot.pk, worker="bench", lease=timedelta(minutes=1), limit=8, bulk=bulk
                )
                times.append((time.perf_counter() - started) * 1000)
                assert len(got) == 8
                OutboundMessage.objects.filter(pk__in=[m.pk for m in got]).update(
                    state=State.PENDING, lease_owner="", lease_expires_at=None
                )
            return statistics.median(times)

        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {OutboundMessage._meta.db_table}")
        with_index = (median_claim_ms(other, bulk=False), median_claim_ms(sender, bulk=True))
        with connection.cursor() as cursor:
            cursor.execute("DROP INDEX outbox_reply_due_idx")
            cursor.execute(f"ANALYZE {OutboundMessage._meta.db_table}")
        connection.close()  # the prepared statements' plans go with the connection
        without = median_claim_ms(other, bulk=False)
        print(f"due broadcast messages   {args.chats} (one bot), due replies 10 (another bot)")
        print(
            f"replies' claim           {with_index[0]:.2f} ms median with outbox_reply_due_idx, {without:.2f} without"
        )
        print(f"broadcast's claim        {with_index[1]:.2f} ms median (outbox_bulk_due_idx)")
    finally:
        from django.db import connections

        connections.close_all()
        c.drop_database(DB)


if __name__ == "__main__":
    main()
