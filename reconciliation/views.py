"""Operations endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import hmac
import logging

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST

from core import connections
from core.metrics import exposition
from reconciliation.metrics import StateCollector
from reconciliation.sweeper import sweeper_last_run

logger = logging.getLogger(__name__)


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


def readyz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, str] = {}
    ok, detail = connections.check_database()
    checks["database"] = "ok" if ok else f"unavailable: {detail}"
    broker_ok, detail = connections.check_broker()
    checks["broker"] = "ok" if broker_ok else f"unavailable: {detail}"
    ok = ok and broker_ok
    if connections.broker_kind(settings.CELERY_BROKER_URL) != "redis":
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
    """Prometheus text format: the counters and histograms every process shipped to Redis
    (core/metrics.py), plus the current-state gauges
    (reconciliation/metrics.py), read with a fixed number of queries."""
    refused = _metrics_refused(request)
    if refused is not None:
        return refused
    body = exposition([StateCollector()])
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
