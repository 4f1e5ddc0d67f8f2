"""The operators' back office: dead-letter triage with a safe Retry, bulk retry and recover
since, reconciliation decisions, read-only audit, masked payloads, bot pause/resume.

Every button follows Django's pattern: a confirmation page with a required reason, a POST with
CSRF, permission checks, a triage service, an audit entry. Each model is registered once, by
its module here: dead_letters, bulk_retries, cases, audit, payloads, other_apps (outbox's
messages, bots' updates and bots, whose buttons call reconciliation's services, which those
apps cannot import) and schedules (django-celery-beat's crontabs). More: docs/DESIGN.md."""

# Imported for their registrations: Django's autodiscover imports this package only.
from reconciliation.admin import audit, bulk_retries, cases, dead_letters, other_apps, payloads, schedules  # noqa: F401
