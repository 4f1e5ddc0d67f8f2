"""Random ids that are unique in practice and need not be secret (trace ids, the rate limit's
window entries)."""

import random


def random_id() -> str:
    """32 hex digits from Python's generator, which is reseeded from the OS in every forked
    child (gunicorn's and Celery's), rather than uuid4's read of the OS's random source: a
    system call per id that lets go of the GIL and waits to get it back."""
    return f"{random.getrandbits(128):032x}"
