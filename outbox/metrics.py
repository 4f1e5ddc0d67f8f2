"""Prometheus counters and histograms of what happens, in one module at the bottom of the
dependency order (reconciliation -> bots -> outbox), so every app records without importing
upward.

With PROMETHEUS_MULTIPROC_DIR set (before this module is imported), prometheus-client writes
each process's samples to files in that directory and /metrics sums them: every gunicorn
worker and every Celery prefork child counts. Unset, the registry is the process's own (the
default for `manage.py runserver` and the tests that record in-process).

Labels are bounded: bot names, method names, error classes, consumer names; never chat ids.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)

# `_created` series double the output and no rule or panel reads them.
disable_created_metrics()

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # A Celery worker may start before the web master has made it.
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

UPDATES = Counter(
    "dovecote_updates_received",
    "Webhook requests by outcome: stored, duplicate, refused (4xx), unavailable (503)",
    ["bot", "outcome"],
)
CONSUMER_RUNS = Counter(
    "dovecote_consumer_runs",
    "Consumer run executions by consumer and outcome (done, retry, dead-lettered, deferred, ...)",
    ["consumer", "outcome"],
)
SENDS = Counter(
    "dovecote_sends",
    "Bot API requests by bot, method and outcome class (ok, transient, rate_limited, ambiguous, ...)",
    ["bot", "method", "outcome"],
)
RETRIES = Counter(
    "dovecote_send_retries", "Outbound messages scheduled for another attempt, by error class", ["reason"]
)
DEAD_LETTERS = Counter(
    "dovecote_dead_letters", "Dead letters written (final failures), by kind and reason", ["kind", "reason"]
)
# Known from the start, so the first dead letter of a kind is an increase from 0 that
# increase() sees (a series born at 1 would not alert).
for _kind in ("message", "consumer_run"):
    for _reason in ("permanent", "exhausted", "expired"):
        DEAD_LETTERS.labels(kind=_kind, reason=_reason)
CASES_OPENED = Counter("dovecote_reconciliation_cases_opened", "Reconciliation cases opened, by kind", ["kind"])

WEBHOOK_SECONDS = Histogram(
    "dovecote_webhook_duration_seconds",
    "Time to handle one webhook request",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
BOT_API_SECONDS = Histogram(
    "dovecote_bot_api_request_duration_seconds",
    "Time of one Bot API call, by method",
    ["method"],
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
REPLY_SECONDS = Histogram(
    "dovecote_reply_latency_seconds",
    "Update received to reply sent",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
)


_SEND_SERIES_STARTED: set[tuple[str, str]] = set()


def count_send(bot: str, method: str, outcome: str) -> None:
    """One Bot API request. The first of a bot and method in this process also starts its
    `ok` and `transient` series at 0, so the first errors of an outage are an increase that
    rate() sees (a series born at 3 counts as no increase)."""
    if (bot, method) not in _SEND_SERIES_STARTED:
        _SEND_SERIES_STARTED.add((bot, method))
        for started in ("ok", "transient"):
            SENDS.labels(bot=bot, method=method, outcome=started)
    SENDS.labels(bot=bot, method=method, outcome=outcome).inc()


def observe_replies(message_ids: Iterable[int]) -> None:
    """Update received -> reply sent, for the just-sent messages that answer an update (one
    query for the batch)."""
    from outbox.models import OutboundMessage

    ids = list(message_ids)
    if not ids:
        return
    rows = OutboundMessage.objects.filter(pk__in=ids, source_update__isnull=False, sent_at__isnull=False).values_list(
        "sent_at", "source_update__received_at"
    )
    for sent_at, received_at in rows:
        REPLY_SECONDS.observe(max(0.0, (sent_at - received_at).total_seconds()))


def exposition(extra: Iterable[Any] = ()) -> bytes:
    """The text format for /metrics: this process's (or, in multiprocess mode, every live and
    dead process's) samples, plus the collectors in `extra` (current-state gauges)."""
    registry = CollectorRegistry()  # no auto_describe: it would collect (query) twice
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:
        for collector in (UPDATES, CONSUMER_RUNS, SENDS, RETRIES, DEAD_LETTERS, CASES_OPENED):
            registry.register(collector)
        for collector in (WEBHOOK_SECONDS, BOT_API_SECONDS, REPLY_SECONDS):
            registry.register(collector)
    for collector in extra:
        registry.register(collector)
    return generate_latest(registry)


def mark_process_dead(pid: int) -> None:
    """A gunicorn worker or Celery child exited: drop its live-gauge files (counters stay)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(pid)
