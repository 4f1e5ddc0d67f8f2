"""`slow_writer`: answers every message; a message starting with "hold" keeps the reply's
transaction open for HOLD_SECONDS after writing it, as a consumer doing more work in its
transaction would (a CRM call, a second table)."""

from __future__ import annotations

import time

from django.db import transaction

from bots.registry import ConsumerContext, consumer

HOLD_SECONDS = 3.0


@consumer("slow_writer", update_types=["message"], max_attempts=2)
def slow_writer(ctx: ConsumerContext) -> str:
    with transaction.atomic():
        ctx.reply(f"re: {ctx.text}")
        if ctx.text.startswith("hold"):
            time.sleep(HOLD_SECONDS)
    return "answered"


LONG_SECONDS = 4.0


@consumer("long_runner", update_types=["message"], max_attempts=2)
def long_runner(ctx: ConsumerContext) -> str:
    """Works longer than a short lease on messages starting with "long"; its worker is alive."""
    if not ctx.text.startswith("long"):
        return "not-mine"
    time.sleep(LONG_SECONDS)
    return "worked"
