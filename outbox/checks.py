"""System checks: configurations that would break a delivery guarantee are refused at start
(`manage.py check`, and `migrate` in the release phase, run them; so does a Celery worker's
start, project.failclosed.refuse_to_start_worker)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

# Time a worker may need after its request's wait ran out: recording the outcome (two
# statements) on a busy database.
RECORD_MARGIN_SECONDS = 5.0


def longest_send_seconds() -> float:
    """How long a worker may hold a claimed message: the drain's wait for the batch's
    rate-limit slots, the worker's own wait for the answer (connect + twice the read timeout
    + slack, after which it records `unknown` itself) and recording the outcome."""
    from outbox import botapi
    from outbox.sending import batch

    return batch.SLOT_HORIZON_SECONDS + botapi.send_timeout() + RECORD_MARGIN_SECONDS


@register("dovecote")
def send_lease_outlasts_a_send(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A lease shorter than a send lets the sweeper give up a send that is still out: the
    answer then settles it late (outbox.transitions.settle_late_success), but meanwhile the
    message shows `unknown` with a case, and a resend could race the answer."""
    lease = float(settings.DOVECOTE_SEND_LEASE_SECONDS)
    needed = longest_send_seconds()
    if lease > needed:
        return []
    return [
        Error(
            f"DOVECOTE_SEND_LEASE_SECONDS={lease:g} is not longer than a send may take ({needed:.1f} s with "
            f"DOVECOTE_TELEGRAM_CONNECT_TIMEOUT={settings.DOVECOTE_TELEGRAM_CONNECT_TIMEOUT:g} and "
            f"DOVECOTE_TELEGRAM_READ_TIMEOUT={settings.DOVECOTE_TELEGRAM_READ_TIMEOUT:g}).",
            hint="Raise DOVECOTE_SEND_LEASE_SECONDS, or lower the Telegram timeouts.",
            id="dovecote.E001",
        )
    ]
