"""Start-up checks: a consumer's time limit must be below the run lease.

A run still going when its lease runs out is taken for lost: the sweeper hands it to another
worker while the first may still be working. The time limit ends the run (as a failed attempt)
before that can happen. `manage.py` commands (`migrate` in the release phase, `runserver`,
`check`) refuse to run with an error (Django's system checks), and so does a Celery worker
(`refuse_to_start_worker`).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from bots import registry


def consumer_timeout_problems() -> list[str]:
    """One sentence per consumer (or the default) whose time limit is not below the lease."""
    lease = float(settings.DOVECOTE_CONSUMER_LEASE_SECONDS)
    problems = []
    default = float(settings.DOVECOTE_CONSUMER_TIMEOUT_SECONDS)
    if not 0 < default < lease:
        problems.append(
            f"DOVECOTE_CONSUMER_TIMEOUT_SECONDS ({default:g}) must be above 0 and below "
            f"DOVECOTE_CONSUMER_LEASE_SECONDS ({lease:g})"
        )
    for spec in registry.registered().values():
        if spec.timeout is not None and not 0 < spec.timeout < lease:
            problems.append(
                f"consumer {spec.name!r}: timeout ({spec.timeout:g}) must be above 0 and below "
                f"DOVECOTE_CONSUMER_LEASE_SECONDS ({lease:g})"
            )
    return problems


@checks.register("dovecote")
def check_consumer_timeouts(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(
            problem,
            hint="A run past its lease is handed to another worker while the first may still run it.",
            id="bots.E001",
        )
        for problem in consumer_timeout_problems()
    ]


def refuse_to_start_worker(**kwargs: Any) -> None:
    """Celery's worker_init: Celery runs Django's checks but ignores their errors, and logs
    (does not raise) a receiver's exception; SystemExit does stop it."""
    problems = consumer_timeout_problems()
    if problems:
        raise SystemExit("dovecote: refusing to start the worker: " + "; ".join(problems))
