"""Ids that are unique in practice and need not be secret: trace ids, which sort by the time
they were made, and the rate limit's window entries, which are plain random. And the 64-bit
ids (rows, chats, bots) an operator types, read from text."""

import random
import re
import time

# ASCII digits: str.isdigit() is also true of "²", which int() refuses.
_INT64_TEXT = re.compile(r"-?[0-9]{1,19}")


def random_id() -> str:
    """32 hex digits from Python's generator, which is reseeded from the OS in every forked
    child (gunicorn's and Celery's), rather than uuid4's read of the OS's random source: a
    system call per id that lets go of the GIL and waits to get it back."""
    return f"{random.getrandbits(128):032x}"


def time_ordered_id() -> str:
    """32 hex digits that sort by the time they were made: the milliseconds since the epoch
    (12 digits) and then 80 random bits, as a UUIDv7 lays them out. For ids that a B-tree index
    holds on a table that only grows (the trace ids of updates, consumer runs and messages): a
    new id goes to the index's right-hand edge, as a serial key does, not to a random leaf that
    PostgreSQL must read in, write back and, after each checkpoint, write whole into the WAL
    (docs/PERFORMANCE.md)."""
    return f"{time.time_ns() // 1_000_000:012x}{random.getrandbits(80):020x}"


def int64_or_none(text: str) -> int | None:
    """The signed 64-bit integer `text` spells (digits, an optional minus), else None: a row,
    chat or bot id from a search box, a query parameter or a URL."""
    if not _INT64_TEXT.fullmatch(text):
        return None
    value = int(text)
    return value if -(2**63) <= value < 2**63 else None
