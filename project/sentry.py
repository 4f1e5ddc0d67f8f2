"""Optional error reporting to Sentry: on when SENTRY_DSN is set, off (and not imported) when
it is not. Errors of the web process (Django) and of tasks (Celery) are reported with what the
logs would carry, masked the same way: no bot token, phone number or message text."""

from __future__ import annotations

from typing import Any

# The parts of an event or breadcrumb that carry what the code said or was given (an error's
# text, a log line, a URL): masked as the logs are (core/logs.py). Ids and timestamps are not.
_FREE_TEXT = ("message", "logentry", "exception", "breadcrumbs", "request", "extra", "data")


def _masked(event: Any, hint: Any = None) -> Any:
    from core.logs import _mask_values

    for key in _FREE_TEXT:
        if key in event:
            event[key] = _mask_values(event[key])
    return event


def init_sentry(dsn: str) -> bool:
    """Start Sentry's client with its Django and Celery integrations when `dsn` is set.
    Returns whether it did. Request bodies, local variables and personal data stay out of
    events: a webhook's body is a user's message."""
    if not dsn:
        return False
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration
    from sentry_sdk.integrations.django import DjangoIntegration

    sentry_sdk.init(
        dsn=dsn,
        integrations=[DjangoIntegration(), CeleryIntegration()],
        max_request_body_size="never",
        data_collection={
            "user_info": False,
            "http_bodies": [],
            "stack_frame_variables": False,
            "database_query_data": False,
        },
        traces_sample_rate=0.0,
        before_send=_masked,
        before_breadcrumb=_masked,
    )
    return True
