"""Idempotency-Key records for the REST API (Stripe's replay, the IETF draft's 409/422).

The first request with a key writes an in-progress record (committed at once, so a
concurrent retry sees it and gets 409); its successful answer is stored and replayed to
retries with the same body; a different body under the same key gets 422. A request that
fails validation leaves no record, so the client may correct it and reuse the key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from outbox.models import IdempotencyRecord

# An in-progress record this old belongs to a request that died (a killed web worker);
# a retry takes it over. Enqueueing is idempotent by itself, so that is safe.
STALE_IN_PROGRESS = timedelta(seconds=60)


def request_fingerprint(data: Any) -> str:
    """sha256 of the request body in a canonical form (key order does not matter)."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    # A body may hold half a surrogate pair ("\ud800" in its JSON): fingerprinted all the
    # same, and refused by the outbox with a 400.
    return hashlib.sha256(canonical.encode(errors="surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Begun:
    outcome: str  # "new" | "replay" | "mismatch" | "in_progress"
    record: IdempotencyRecord


def idempotency_begin(*, scope: str, key: str, fingerprint: str, user: Any = None) -> Begun:
    """Claim `key` in `scope` for this request, or say why not."""
    for _ in range(3):
        try:
            with transaction.atomic():
                record = IdempotencyRecord.objects.create(
                    scope=scope, key=key, fingerprint=fingerprint, user=user if getattr(user, "pk", None) else None
                )
            return Begun("new", record)
        except IntegrityError:
            record = IdempotencyRecord.objects.filter(scope=scope, key=key).first()
            if record is None:
                continue  # abandoned meanwhile: try to claim it again
        if record.fingerprint != fingerprint:
            return Begun("mismatch", record)
        if not record.in_progress:
            return Begun("replay", record)
        now = timezone.now()
        taken = IdempotencyRecord.objects.filter(
            pk=record.pk, in_progress=True, created_at__lt=now - STALE_IN_PROGRESS
        ).update(created_at=now)
        return Begun("new" if taken else "in_progress", record)
    raise RuntimeError(f"could not claim idempotency key {key!r}")


def idempotency_complete(record: IdempotencyRecord, *, status: int, body: Any) -> None:
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        in_progress=False, response_status=status, response_body=body, completed_at=timezone.now()
    )


def idempotency_abandon(record: IdempotencyRecord) -> None:
    """The request was refused before anything happened: free the key."""
    IdempotencyRecord.objects.filter(pk=record.pk, in_progress=True).delete()


def idempotency_cutoff(now: datetime) -> datetime:
    """Records created before this may go: kept DOVECOTE_IDEMPOTENCY_KEEP_HOURS, never under
    24 hours (the contract)."""
    return now - timedelta(hours=max(24, settings.DOVECOTE_IDEMPOTENCY_KEEP_HOURS))


def idempotency_records_prune(*, older_than: datetime | None = None) -> int:
    """Delete records past their retention (never younger than 24 hours). The sweeper
    deletes them in budgeted batches instead (outbox/retention.py)."""
    limit = idempotency_cutoff(timezone.now())
    if older_than is None or older_than > limit:
        older_than = limit
    deleted, _ = IdempotencyRecord.objects.filter(created_at__lt=older_than).delete()
    return deleted
