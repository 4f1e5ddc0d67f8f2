"""The operators' dashboard numbers (overall or per bot) and their small server-rendered SVG
charts. /metrics exports the same numbers for Prometheus."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, F, Min, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from bots import registry
from bots.models import Bot, ConsumerRun, InboundUpdate, RunState, UpdateState
from outbox.circuits import bot_scope, consumer_scope
from outbox.models import Circuit, CircuitState, DeadLetter, DeadLetterStatus, OutboundMessage, State
from reconciliation.models import CaseStatus, ReconciliationCase

LATENCY_WINDOW = timedelta(hours=1)
FAILED_SHARE_WINDOW = timedelta(hours=24)
RETRY_DAYS = 7
LATENCY_SAMPLE = 10_000  # newest replies considered for the percentiles


# Backlog: only the states of work not yet finished, each read through a partial index (or
# the outbox's state index), so a refresh costs the same with a million sent rows.
BACKLOG_STATES = {
    "outbox": [State.PENDING, State.RETRY, State.SENDING, State.UNKNOWN],
    "consumer_runs": [RunState.PENDING, RunState.RETRY, RunState.RUNNING],
    "inbox": [UpdateState.NEW],
}


def _by_state(qs: Any, states: Any) -> dict[str, int]:
    if isinstance(states, list):
        counts = {str(value): 0 for value in states}
        qs = qs.filter(state__in=states)
    else:
        counts = {value: 0 for value, _ in states.choices}
    counts.update({r["state"]: r["n"] for r in qs.values("state").annotate(n=Count("id")).order_by()})
    return counts


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None without data."""
    if not sorted_values:
        return None
    rank = max(0, min(len(sorted_values) - 1, round(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


def dashboard_numbers(bot_id: int | None = None) -> dict[str, Any]:
    """The seeds' signals: backlog by state, webhook-to-reply time, failed share, retries per
    day, oldest waiting item, open dead letters by reason, open cases, circuit states."""
    now = timezone.now()
    messages = OutboundMessage.objects.all()
    updates = InboundUpdate.objects.all()
    runs = ConsumerRun.objects.all()
    letters = DeadLetter.objects.filter(status=DeadLetterStatus.OPEN)
    cases = ReconciliationCase.objects.filter(status=CaseStatus.OPEN)
    if bot_id is not None:
        messages, updates = messages.filter(bot_id=bot_id), updates.filter(bot_id=bot_id)
        runs, letters = runs.filter(bot_id=bot_id), letters.filter(bot_id=bot_id)
        cases = cases.filter(message__bot_id=bot_id)

    replies = (
        # updated_at >= sent_at: the (state, updated_at) index finds the window's sent rows.
        messages.filter(
            state=State.SENT,
            updated_at__gte=now - LATENCY_WINDOW,
            sent_at__gte=now - LATENCY_WINDOW,
            source_update__isnull=False,
        )
        .order_by("-sent_at")
        .values_list("sent_at", "source_update__received_at")[:LATENCY_SAMPLE]
    )
    latencies = sorted(max(0.0, (sent - received).total_seconds()) for sent, received in replies)

    finished = _by_state(
        messages.filter(updated_at__gte=now - FAILED_SHARE_WINDOW, state__in=[State.SENT, State.FAILED]), State
    )
    done = finished[State.SENT] + finished[State.FAILED]

    # Retries per day from the messages changed in the last RETRY_DAYS days (their attempts
    # after the first), through the (state, updated_at) index: bounded by a week's traffic,
    # not the whole attempts table (whose started_at has no index).
    first_day = (timezone.localtime(now) - timedelta(days=RETRY_DAYS - 1)).date()
    since = timezone.make_aware(datetime.combine(first_day, datetime.min.time()))
    retry_rows = (
        messages.filter(state__in=[s.value for s in State], updated_at__gte=since, attempts__gt=1)
        .annotate(day=TruncDate("updated_at"))
        .values("day")
        .annotate(n=Sum(F("attempts") - 1))
        .order_by()
    )
    per_day = {row["day"]: row["n"] for row in retry_rows}
    retries = [
        {"day": (first_day + timedelta(days=i)).isoformat(), "n": per_day.get(first_day + timedelta(days=i), 0)}
        for i in range(RETRY_DAYS)
    ]

    oldest = {
        "inbox": updates.filter(state=UpdateState.NEW).aggregate(t=Min("received_at"))["t"],
        "consumer_runs": runs.filter(state__in=[RunState.PENDING, RunState.RETRY]).aggregate(t=Min("created_at"))["t"],
        "outbox": messages.filter(state__in=[State.PENDING, State.RETRY]).aggregate(t=Min("created_at"))["t"],
    }
    oldest_age = {k: (None if t is None else round((now - t).total_seconds(), 1)) for k, t in oldest.items()}
    ages = [a for a in oldest_age.values() if a is not None]

    bots = Bot.objects.filter(pk=bot_id) if bot_id is not None else Bot.objects.all()
    scopes = [bot_scope(b.pk) for b in bots] + [consumer_scope(name) for name in registry.registered()]
    stored = {c.scope: c for c in Circuit.objects.filter(scope__in=scopes)}
    if bot_id is None:
        stored.update({c.scope: c for c in Circuit.objects.exclude(state=CircuitState.CLOSED)})
    names = {bot_scope(b.pk): f"bot {b.name}" for b in bots}
    circuits = [
        {
            "scope": scope,
            "label": names.get(scope, scope.replace(":", " ")),
            "state": stored[scope].state if scope in stored else CircuitState.CLOSED,
            "manual": bool(stored.get(scope) and stored[scope].manual),
            "reason": stored[scope].reason if scope in stored else "",
        }
        for scope in sorted(set(scopes) | set(stored))
    ]
    return {
        "generated_at": now.isoformat(),
        "bot": bot_id,
        "backlog": {
            "inbox": _by_state(updates, BACKLOG_STATES["inbox"]),
            "consumer_runs": _by_state(runs, BACKLOG_STATES["consumer_runs"]),
            "outbox": _by_state(messages, BACKLOG_STATES["outbox"]),
        },
        "reply_latency": {
            "window_seconds": int(LATENCY_WINDOW.total_seconds()),
            "count": len(latencies),
            "p50": _percentile(latencies, 0.5),
            "p95": _percentile(latencies, 0.95),
        },
        "failed_share": {
            "window_seconds": int(FAILED_SHARE_WINDOW.total_seconds()),
            "sent": finished[State.SENT],
            "failed": finished[State.FAILED],
            "share": (finished[State.FAILED] / done) if done else 0.0,
            "percent": round(100.0 * finished[State.FAILED] / done, 1) if done else 0.0,
        },
        "retries_per_day": retries,
        "oldest_waiting": oldest_age,
        "oldest_waiting_seconds": max(ages) if ages else None,
        "dead_letters_by_reason": {
            r["reason_class"]: r["n"] for r in letters.values("reason_class").annotate(n=Count("id")).order_by("-n")
        },
        "dead_letters_open": letters.count(),
        "open_reconciliation_cases": cases.count(),
        "circuits": circuits,
    }


# --- SVG --------------------------------------------------------------------------------

# A colour per state, the same in every chart (the apps' states share their names).
PALETTE: dict[str, str] = {
    State.PENDING: "#7aa6c2",
    State.RETRY: "#e0a030",
    State.SENDING: "#4a90d9",
    State.SENT: "#3c9a5f",
    State.FAILED: "#c0392b",
    State.CANCELLED: "#999",
    State.UNKNOWN: "#8e44ad",
    UpdateState.NEW: "#7aa6c2",
    RunState.DONE: "#3c9a5f",
    RunState.RUNNING: "#4a90d9",
}


def svg_hbars(values: dict[str, int | float], *, width: int = 320, bar: int = 16, title: str = "") -> SafeString:
    """Horizontal bars, one per label, scaled to the largest value."""
    items = list(values.items())
    top = max([v for _, v in items] + [1])
    label_w, gap = 90, 4
    height = max(1, len(items)) * (bar + gap) + 4
    parts = [
        f'<svg class="dovecote-chart" role="img" aria-label="{escape(title)}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i, (label, value) in enumerate(items):
        y = 2 + i * (bar + gap)
        w = 0 if not value else max(2, int((width - label_w - 50) * value / top))
        color = PALETTE.get(label, "#5b7db1")
        parts.append(
            f'<text x="0" y="{y + bar - 4}" font-size="11">{escape(label)}</text>'
            f'<rect x="{label_w}" y="{y}" width="{w}" height="{bar}" fill="{color}" rx="2"/>'
            f'<text x="{label_w + w + 4}" y="{y + bar - 4}" font-size="11">{value}</text>'
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every label is escaped above


def svg_columns(points: list[tuple[str, int]], *, width: int = 320, height: int = 90, title: str = "") -> SafeString:
    """Vertical columns (e.g. retries per day), labels under them."""
    top = max([v for _, v in points] + [1])
    n = max(1, len(points))
    step = width / n
    chart_h = height - 28
    parts = [
        f'<svg class="dovecote-chart" role="img" aria-label="{escape(title)}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i, (label, value) in enumerate(points):
        h = 0 if not value else max(2, int(chart_h * value / top))
        x = int(i * step + 4)
        parts.append(
            f'<rect x="{x}" y="{12 + chart_h - h}" width="{int(step - 8)}" height="{h}" '
            'fill="#e0a030" rx="2"/>'
            f'<text x="{x}" y="{10 + chart_h - h}" font-size="10">{value}</text>'
            f'<text x="{x}" y="{height - 4}" font-size="9">{escape(label)}</text>'
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every label is escaped above


def dashboard_charts(numbers: dict[str, Any]) -> dict[str, SafeString]:
    backlog = numbers["backlog"]
    return {
        "outbox": svg_hbars(backlog["outbox"], title="outbox by state"),
        "inbox": svg_hbars(backlog["inbox"], title="inbox by state"),
        "runs": svg_hbars(backlog["consumer_runs"], title="consumer runs by state"),
        "dead_letters": svg_hbars(numbers["dead_letters_by_reason"] or {"none": 0}, title="open dead letters"),
        "retries": svg_columns([(r["day"][5:], r["n"]) for r in numbers["retries_per_day"]], title="retries per day"),
    }
