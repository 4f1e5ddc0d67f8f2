"""Start-up in production: the settings refuse to load without the variables they need
(project/settings.py); every process entry point reports that as one line and exits,
before it serves, consumes or schedules anything. A worker also refuses to start on an
error of Dovecote's system checks (refuse_to_start_worker), as `manage.py` commands do."""

import os
import sys
from typing import Any


def load_settings_or_exit() -> None:
    """Load the settings now; a missing production variable ends the process with one line
    naming it (rather than a traceback, or a gunicorn master respawning workers)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    try:
        settings.INSTALLED_APPS  # noqa: B018 - the access loads the settings module
    except ImproperlyConfigured as exc:
        sys.exit(f"dovecote: {exc}")


def refuse_to_start_worker(**kwargs: Any) -> None:
    """Celery's worker_init: Dovecote's own system checks (tag "dovecote": a consumer's time
    limit above 0, a send lease longer than a send) as `manage.py check` and so `migrate` run
    them (SILENCED_SYSTEM_CHECKS honoured alike), their errors in one line. Celery runs Django's checks at start but
    ignores their errors, and logs (does not raise) a receiver's exception; SystemExit does
    stop it."""
    from django.apps import apps
    from django.core import checks

    if not apps.ready:  # Celery's Django fixup sets Django up on this same signal, first
        import django

        django.setup()
    errors = [m for m in checks.run_checks(tags=["dovecote"]) if m.is_serious() and not m.is_silenced()]
    if errors:
        found = "; ".join(f"({message.id}) {message.msg.rstrip('.')}" for message in errors)
        raise SystemExit(f"dovecote: refusing to start the worker: {found}.")
