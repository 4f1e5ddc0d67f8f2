"""Retry policy, in one place: exponential backoff with full jitter, capped."""

import random

from django.conf import settings

# 429s are not the message's fault: this many do not spend its retry budget.
FREE_RATE_LIMITED_ATTEMPTS = 20
# A Celery countdown longer than this is not parked in Redis (its visibility timeout would
# redeliver it); the row's next_attempt_at holds the wait and the sweeper dispatches it.
MAX_BROKER_COUNTDOWN_SECONDS = 60.0
# The most requests a batch of sends has in flight together (and so the HTTP client's
# connections per process): a bot with room for more than DOVECOTE_DRAIN_BATCH_SIZE within
# a batch's slot horizon (a paid broadcast bot, or the limiter off) sends batches up to this
# big (outbox.sending.batch.send_batch_size).
MAX_SEND_BATCH = 32
# ... and a broadcast drain's batch, which waits for no reply: its statements shared by more
# messages (the HTTP client keeps as many connections).
MAX_BULK_BATCH = 64


def answer_wait_seconds() -> float:
    """How long a sender waits for a Bot API call's answer before calling it ambiguous."""
    return settings.DOVECOTE_TELEGRAM_CONNECT_TIMEOUT + settings.DOVECOTE_TELEGRAM_READ_TIMEOUT * 2 + 5


def backoff_seconds(attempt: int, *, base: float | None = None, cap: float | None = None) -> float:
    """Full jitter (AWS architecture blog): uniform in [0, min(cap, base * 2**(attempt-1))],
    never below a tenth of the base so that a retry is never immediate."""
    base = settings.DOVECOTE_RETRY_BASE_SECONDS if base is None else base
    cap = settings.DOVECOTE_RETRY_MAX_SECONDS if cap is None else cap
    ceiling = min(cap, base * (2 ** max(0, attempt - 1)))
    return max(base / 10, random.uniform(0, ceiling))  # noqa: S311 - jitter, not crypto
