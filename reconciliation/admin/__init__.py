"""The operators' back office: dead-letter triage with a safe Retry, bulk retry and recover
since, reconciliation decisions, read-only audit, masked payloads, bot pause/resume.

Every button follows Django's own pattern: object-tools link -> confirmation page with a
required reason -> POST with CSRF -> view wrapped in admin_view -> object and custom
permission checks -> triage service -> log_change + AuditEntry -> message -> redirect.

Each model is registered once, by the module that defines its admin:

- dead_letters.py: outbox.DeadLetter (triage: retry, resolve, discard, bulk retry, recover since)
- bulk_retries.py: BulkRetry
- cases.py: ReconciliationCase
- audit.py: AuditEntry
- payloads.py: PayloadVersion (and the masked payload view the other pages share)
- other_apps.py: outbox.OutboundMessage, bots.InboundUpdate, bots.Bot
- schedules.py: django-celery-beat's CrontabSchedule, registered again with a summary that
  survives a crontab celery cannot parse

The dead-letter, message, update and bot admins of outbox/bots are registered here, because
their buttons call reconciliation services (which outbox and bots cannot import); those apps
define the base classes and register none of these four.
"""

# Imported for their registrations: Django's autodiscover imports this package only.
from reconciliation.admin import audit, bulk_retries, cases, dead_letters, other_apps, payloads, schedules  # noqa: F401
