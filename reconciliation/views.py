"""Operations endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from project import connections
from reconciliation.selectors import queue_status
from reconciliation.sweeper import sweeper_last_run

logger = logging.getLogger(__name__)


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


def readyz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, str] = {}
    ok = True
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except DatabaseError as exc:
        ok, checks["database"] = False, f"unavailable: {type(exc).__name__}"
    broker_ok, detail = connections.check_broker()
    checks["broker"] = "ok" if broker_ok else f"unavailable: {detail}"
    ok = ok and broker_ok
    if settings.REDIS_URL and connections.broker_kind(settings.CELERY_BROKER_URL) != "redis":
        # Another broker (RabbitMQ): Redis holds only the limiter and the wake-up keys. Shown,
        # but it does not make the process unready: the webhook still stores and answers.
        redis_ok, detail = connections.check_redis()
        checks["redis"] = "ok" if redis_ok else f"unavailable: {detail}"
    # Informational: a dead beat does not make this process unready, but it must be seen.
    last_run = sweeper_last_run()
    sweeper = {
        "last_run": last_run.isoformat() if last_run else None,
        "seconds_ago": round((timezone.now() - last_run).total_seconds(), 1) if last_run else None,
    }
    return JsonResponse({"ok": ok, "checks": checks, "sweeper": sweeper}, status=200 if ok else 503)


def _metrics_refused(request: HttpRequest) -> HttpResponse | None:
    """/metrics shows queue sizes, bot names and error rates: with DOVECOTE_METRICS_TOKEN it
    needs `Authorization: Bearer <token>`; without one it is open only with DEBUG on."""
    token = settings.DOVECOTE_METRICS_TOKEN
    if not token:
        if settings.DEBUG:
            return None
        return HttpResponse("set DOVECOTE_METRICS_TOKEN to scrape /metrics\n", status=403, content_type="text/plain")
    given = request.headers.get("Authorization", "")
    if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        return None
    refused = HttpResponse("a bearer token is required\n", status=401, content_type="text/plain")
    refused["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return refused


def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text format (version 0.0.4)."""
    refused = _metrics_refused(request)
    if refused is not None:
        return refused
    status = queue_status()
    lines: list[str] = []

    def gauge(name: str, help_text: str, samples: list[tuple[dict[str, str], float | int | None]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(
                f"{name}{{{label_text}}} {0 if value is None else value}"
                if label_text
                else f"{name} {0 if value is None else value}"
            )

    for queue in ("inbox", "consumer_runs", "outbox"):
        gauge(
            f"dovecote_{queue}_items",
            f"{queue} rows by state",
            [({"state": state}, n) for state, n in status[queue].items()],
        )
    gauge(
        "dovecote_oldest_waiting_seconds",
        "age of the oldest waiting item by queue",
        [({"queue": q}, age) for q, age in status["oldest_waiting"].items()],
    )
    gauge(
        "dovecote_sends_total",
        "Bot API requests by outcome",
        [({"outcome": outcome}, n) for outcome, n in status["sends_by_outcome"].items()],
    )
    gauge("dovecote_dead_letters_open", "open dead letters", [({}, status["dead_letters"]["open"])])
    gauge(
        "dovecote_dead_letters_open_by_reason",
        "open dead letters by reason",
        [({"reason": r}, n) for r, n in status["dead_letters"]["by_reason"].items()],
    )
    gauge(
        "dovecote_reconciliation_cases_open", "open reconciliation cases", [({}, status["open_reconciliation_cases"])]
    )
    gauge(
        "dovecote_circuit_open",
        "1 while a destination's circuit is open or half-open (attempts stopped, queue kept)",
        [({"scope": scope, "state": state}, 1) for scope, state in status["circuits_open"].items()],
    )
    last_run = sweeper_last_run()
    gauge(
        "dovecote_sweeper_last_run_timestamp_seconds",
        "when the sweeper last finished a sweep (Unix time; 0 if never): alert when it falls behind",
        [({}, last_run.timestamp() if last_run else 0)],
    )
    _dashboard_gauges(gauge)
    return HttpResponse("\n".join(lines) + "\n", content_type="text/plain; version=0.0.4; charset=utf-8")


def _dashboard_gauges(gauge: Any) -> None:
    """The dashboard's numbers, overall and per bot, under their own names."""
    from bots.models import Bot
    from reconciliation.dashboard import dashboard_numbers

    overall = dashboard_numbers()
    latency = overall["reply_latency"]
    gauge(
        "dovecote_reply_latency_seconds",
        "webhook to sent reply over the last hour, by quantile",
        [({"quantile": "0.5"}, latency["p50"]), ({"quantile": "0.95"}, latency["p95"])],
    )
    gauge("dovecote_replies_last_hour", "replies sent for an update in the last hour", [({}, latency["count"])])
    gauge(
        "dovecote_failed_share",
        "failed / (sent + failed) over the last 24 hours",
        [({}, overall["failed_share"]["share"])],
    )
    gauge(
        "dovecote_retries_per_day",
        "Bot API attempts after the first, by day",
        [({"day": row["day"]}, row["n"]) for row in overall["retries_per_day"]],
    )
    gauge(
        "dovecote_circuit_paused",
        "1 while an operator has paused the bot or consumer by hand",
        [({"scope": c["scope"]}, 1 if c["manual"] and c["state"] == "open" else 0) for c in overall["circuits"]],
    )
    per_bot = {bot.name: dashboard_numbers(bot.pk) for bot in Bot.objects.only("pk", "name")}
    gauge(
        "dovecote_bot_outbox_items",
        "outbox rows by bot and state",
        [
            ({"bot": name, "state": state}, n)
            for name, numbers in per_bot.items()
            for state, n in numbers["backlog"]["outbox"].items()
        ],
    )
    gauge(
        "dovecote_bot_reply_latency_seconds",
        "webhook to sent reply over the last hour, by bot and quantile",
        [
            ({"bot": name, "quantile": q}, numbers["reply_latency"][k])
            for name, numbers in per_bot.items()
            for q, k in (("0.5", "p50"), ("0.95", "p95"))
        ],
    )
    gauge(
        "dovecote_bot_dead_letters_open",
        "open dead letters by bot and reason",
        [
            ({"bot": name, "reason": r}, n)
            for name, numbers in per_bot.items()
            for r, n in numbers["dead_letters_by_reason"].items()
        ],
    )
    gauge(
        "dovecote_bot_oldest_waiting_seconds",
        "age of the bot's oldest waiting item",
        [({"bot": name}, numbers["oldest_waiting_seconds"]) for name, numbers in per_bot.items()],
    )
