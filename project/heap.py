"""The garbage collector and a long-running process's startup heap.

Python's full (generation 2) collection walks every object the collector tracks. A web or
worker process holds a few hundred thousand of them from its imports alone (Django, Celery,
python-telegram-bot, the models), none of which ever becomes garbage, so each full
collection stopped the process for 37-85 ms on a 2-core host: the echoes it held up were the
slowest 1% of `bench/sidebyside.py`'s end-to-end latencies. Frozen once the process is ready
(gc.freeze: moved to a permanent generation the collector skips), what is left to walk is
what the process made since, and cycles among those are still collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then set the rest aside for good (gc.freeze).
    Called once a process has imported what it runs: a gunicorn worker after loading the
    app, a Celery worker (and each prefork child) when it is ready. Returns how many objects
    are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
