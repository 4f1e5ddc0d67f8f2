"""Start-up checks: every consumer has a time limit above 0.

A run is interrupted at its consumer's time limit (a failed attempt); its lease is short and
renewed by its live worker meanwhile (core/workers.py), so the limit may be as long as the
work needs. `manage.py` commands (`migrate` in the release phase, `runserver`, `check`)
refuse to run with an error (Django's system checks), and so does a Celery worker
(project.failclosed.refuse_to_start_worker runs the same checks).
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from bots import registry


def consumer_timeout_problems() -> list[str]:
    """One sentence per consumer whose own time limit is not above 0 (the default's range
    is checked with the other settings, project/settings.py)."""
    problems = []
    for spec in registry.registered().values():
        if spec.timeout is not None and not spec.timeout > 0:
            problems.append(f"consumer {spec.name!r}: timeout ({spec.timeout:g}) must be above 0")
    return problems


@checks.register("dovecote")
def check_consumer_timeouts(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(
            problem,
            hint="A run is interrupted at its consumer's time limit, as a failed attempt.",
            id="bots.E001",
        )
        for problem in consumer_timeout_problems()
    ]
