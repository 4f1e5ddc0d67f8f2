"""The garbage collector in a long-running web or worker process.

Python's full (generation 2) collection walks every object the collector tracks. A web or
worker process holds a few hundred thousand of them from its imports alone (Django, Celery,
python-telegram-bot, the models), none of which ever becomes garbage, so each full
collection stopped the process for 37-85 ms on a 2-core host: the echoes it held up were the
slowest 1% of `bench/sidebyside.py`'s end-to-end latencies. Frozen once the process is ready
(gc.freeze: moved to a permanent generation the collector skips), what is left to walk is
what the process made since, and cycles among those are still collected as before.

The youngest generation is collected after 10,000 new container objects instead of 700: a
router's batch makes tens of thousands of short-lived ones (rows, model instances, JSON),
and at 700 the collector ran every few dozen of them. In `bench/hotpath_cpu.py`'s router
the collector's time per update fell from ~80 µs (default) to ~30 µs (frozen) to ~7 µs
(frozen, 10,000). The cost: at most that many more objects wait for their collection.
"""

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
