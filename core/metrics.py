"""Prometheus counters and histograms of what happens, in one module at the bottom of the
dependency order, so every app records without importing upward.

Each process counts in its own registry and a thread ships what it counted to one Redis hash
every second (`ship`), so `/metrics` on any web process reads the totals of every process on
every host. A shipment is added once even when its answer was lost (`Shipper`). Labels are
bounded (bots, methods, error classes, consumers; never chat ids). Why: docs/DESIGN.md."""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# `_created` series double the output and no rule or panel reads them.
disable_created_metrics()

SHIP_SECONDS = 1.0

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


def observe_reply_seconds(seconds: Iterable[float]) -> None:
    for value in seconds:
        REPLY_SECONDS.observe(max(0.0, value))


COUNTED = (
    UPDATES,
    CONSUMER_RUNS,
    SENDS,
    RETRIES,
    DEAD_LETTERS,
    CASES_OPENED,
    WEBHOOK_SECONDS,
    BOT_API_SECONDS,
    REPLY_SECONDS,
)


def _shared_key() -> str:
    from django.conf import settings

    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:metrics"


def _redis() -> Any:
    from core import connections

    return connections.redis_client(timeout=0.5)


_FIELDS: dict[tuple[str, str, tuple[tuple[str, str], ...]], str] = {}


def _field(family: str, sample: str, labels: dict[str, str]) -> str:
    """The hash field of one sample (remembered: the label sets are bounded)."""
    key = (family, sample, tuple(labels.items()))
    field = _FIELDS.get(key)
    if field is None:
        field = _FIELDS[key] = json.dumps([family, sample, labels], sort_keys=True, separators=(",", ":"))
    return field


# Adds one shipment to the totals unless this process's sequence entry says it was added
# already: a retried shipment whose first reply was lost counts once.
# KEYS: the totals hash, this process's sequence entry.
# ARGV: the shipment's sequence, seconds the entry is kept, then field, change, field, change, ...
_SHIP_LUA = """
local seq = tonumber(ARGV[1])
if seq <= tonumber(redis.call('GET', KEYS[2]) or '0') then
  return 0
end
for i = 3, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
"""

# How long Redis remembers a process's last sequence after its last shipment. A retry comes
# a second after the lost reply, so this only has to outlast the longest time one process
# stays cut off from Redis; an entry per process that lived in that time is kept, no more.
SEQUENCE_SECONDS = 24 * 3600


def _sequence_key(process: str) -> str:
    from django.conf import settings

    return f"{settings.DOVECOTE_REDIS_PREFIX}dovecote:metrics:shipped:{process}"


def _process_id() -> str:
    """Unique across hosts and restarts (a container's pid repeats), readable in a key."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class Shipment:
    sequence: int
    changes: dict[str, float]
    totals: dict[str, float]  # the snapshot the changes lead to


class Shipper:
    """This process's counts, added to the shared Redis hash as the change since the last
    shipment. Each shipment is numbered, and one script adds it only if its number is newer
    than the last one Redis holds for this process: a failed shipment (no answer, or an
    answer lost after Redis applied it) is sent again as it was, under the same number, and
    counts once whichever way it failed. What changed meanwhile follows under the next."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.shipped: dict[str, float] = {}
        self.client: Any = None
        self.script: Any = None
        self.process = _process_id()
        self.sequence = 0
        self.pending: Shipment | None = None

    def snapshot(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for metric in COUNTED:
            for family in metric.collect():
                for sample in family.samples:
                    values[_field(family.name, sample.name, sample.labels)] = sample.value
        return values

    def redis(self) -> Any:
        """This process's client (a scrape reads through it too: no new connection each time)."""
        if self.client is None:
            self.client = _redis()
        return self.client

    def ship(self) -> bool:
        """Add what changed since the last shipment; False (and kept for the next one) when
        Redis does not answer or Django is not configured yet."""
        from django.conf import settings

        if not settings.configured:
            return False
        with self.lock:
            if self.pending is not None and not self._send(self.pending):
                return False
            snapshot = self.snapshot()
            # A new series ships even at 0: the first error of an outage is then an increase.
            changed = {k: v - self.shipped.get(k, 0.0) for k, v in snapshot.items() if self.shipped.get(k) != v}
            if not changed:
                return True
            self.sequence += 1
            self.pending = Shipment(self.sequence, changed, snapshot)
            return self._send(self.pending)

    def _send(self, shipment: Shipment) -> bool:
        import redis

        args: list[Any] = [shipment.sequence, SEQUENCE_SECONDS]
        for field, change in shipment.changes.items():
            args += [field, repr(change)]
        try:
            if self.script is None:
                self.script = self.redis().register_script(_SHIP_LUA)
            added = self.script(keys=[_shared_key(), _sequence_key(self.process)], args=args, client=self.redis())
        except (redis.RedisError, OSError) as exc:
            logger.debug("metrics not shipped, kept for the next try: %s", exc)
            return False
        if not added:
            logger.debug("metrics shipment %d was added before its reply got lost", shipment.sequence)
        self.shipped.update(shipment.totals)
        self.pending = None
        return True

    def forked(self) -> None:
        """In a new child (a prefork or gunicorn worker): what the parent counted is the
        parent's to ship (its unanswered shipment too), so the child starts from it, under a
        number sequence of its own; and a fresh lock and connection."""
        self.lock = threading.Lock()
        self.client = None
        self.script = None
        self.process = _process_id()
        self.sequence = 0
        self.pending = None
        self.shipped = self.snapshot()


SHIPPER = Shipper()


def ship() -> bool:
    """Ship this process's counts now (a process about to exit, a scrape, a test)."""
    try:
        return SHIPPER.ship()
    except Exception:
        logger.exception("metrics not shipped")
        return False


def _ship_every_second() -> None:
    while True:
        time.sleep(SHIP_SECONDS)
        ship()


def _start_shipping() -> None:
    threading.Thread(target=_ship_every_second, name="dovecote-metrics", daemon=True).start()


def _child_after_fork() -> None:
    SHIPPER.forked()
    _start_shipping()


# A fork while the shipping thread holds a metric's lock would hand the child a lock that
# nobody releases: fork only between shipments.
os.register_at_fork(
    before=lambda: SHIPPER.lock.acquire(),
    after_in_parent=lambda: SHIPPER.lock.release(),
    after_in_child=_child_after_fork,
)
atexit.register(ship)
_start_shipping()


def prune_bots(existing: Callable[[], Collection[str]]) -> int:
    """Remove from the shared totals the series labelled with a bot that is gone: deleted,
    or renamed (its old name), as Prometheus users expect of a target's label that no longer
    exists. `existing` names the bots there are; it is asked after the series are read, so a
    series of a bot created meanwhile still finds its bot. Returns the number of series
    removed (0 when Redis does not answer: the next sweep tries again).

    A process still counting under the old name (a send in flight at the rename) adds its
    series back with that change alone, and the next prune removes it."""
    import redis

    try:
        client = SHIPPER.redis()
        key = _shared_key()
        fields = client.hkeys(key)
        # bot="" is the webhook's unknown or refused name, not a bot that went away.
        kept = {"", *existing()}
        gone = [field for field in fields if json.loads(field)[2].get("bot", "") not in kept]
        if gone:
            client.hdel(key, *gone)
    except (redis.RedisError, OSError) as exc:
        logger.warning("metrics of deleted or renamed bots not pruned: Redis does not answer (%s)", exc)
        return 0
    return len(gone)


class SharedCounts(Collector):
    """The totals every process has shipped, read from the shared hash at scrape time."""

    def __init__(self, fields: dict[bytes, bytes]) -> None:
        self.fields = fields

    def collect(self) -> Iterator[Metric]:
        by_family: dict[str, list[tuple[str, dict[str, str], float]]] = {}
        for raw, value in self.fields.items():
            family, sample, labels = json.loads(raw)
            by_family.setdefault(family, []).append((sample, labels, float(value)))
        for metric in COUNTED:
            for local in metric.describe():
                family = Metric(local.name, local.documentation, local.type)
                samples = by_family.get(local.name, [])
                # Each label set's histogram samples together, buckets in order of `le`.
                samples.sort(key=_sample_order)
                for sample, labels, value in samples:
                    family.add_sample(sample, labels, value)
                yield family


def _sample_order(sample: tuple[str, dict[str, str], float]) -> tuple:
    name, labels, _ = sample
    rest = sorted((k, v) for k, v in labels.items() if k != "le")
    le = float(labels["le"]) if "le" in labels else 0.0
    return (rest, name.endswith("_bucket") is False, le, name)


def _counted() -> Iterable[Collector]:
    """Every process's totals from Redis. A scrape while Redis is away omits the counters
    (a gap, not a wrong value) and keeps the gauges."""
    import redis

    ship()
    try:
        return [SharedCounts(SHIPPER.redis().hgetall(_shared_key()))]
    except (redis.RedisError, OSError) as exc:
        logger.warning("/metrics without counters: Redis does not answer (%s)", exc)
        return []


def exposition(extra: Iterable[Any] = ()) -> bytes:
    """The text format for /metrics: the counters and histograms of every process, plus the
    collectors in `extra` (current-state gauges)."""
    registry = CollectorRegistry()  # no auto_describe: it would collect (query) twice
    for collector in [*_counted(), *extra]:
        registry.register(collector)
    return generate_latest(registry)
