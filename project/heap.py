"""The garbage collector in a long-running web or worker process.

Once the process is ready its startup heap (imports: Django, Celery, python-telegram-bot, the
models; never garbage) is frozen (gc.freeze), so a full collection walks only what the process
made since; and the youngest generation is collected after 10,000 new objects instead of 700,
since a router's batch makes tens of thousands of short-lived ones. The cost: at most that
many more objects wait for their collection. Why, with the pauses it removed:
docs/DESIGN.md and docs/PERFORMANCE.md."""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000


def tune_garbage_collector() -> int:
    """Collect what startup left as garbage, set the rest aside for good (gc.freeze), and
    collect the youngest generation less often. Called once a process has imported what it
    runs: a gunicorn worker after loading the app, a Celery worker (and each prefork child)
    when it is ready. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    return gc.get_freeze_count()
