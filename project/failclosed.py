"""Start-up in production: the settings refuse to load without the variables they need
(project/settings.py); every process entry point reports that as one line and exits,
before it serves, consumes or schedules anything."""

import os
import sys


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
