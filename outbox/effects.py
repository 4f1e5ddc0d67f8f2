"""The effect ledger barrier: every side effect outside the outbox goes through it.

An effect is keyed by a key stable across retries (``eff:<bot>:<update_id>:<consumer>:<op>``)::

    result = effect_run(key, lambda e: crm.post(..., headers={"Idempotency-Key": e.key}),
                        reconcile=lambda key: crm.lookup(key))

By the ledger row's state: ``done`` is skipped and its result returned; ``started`` under a
live lease raises `EffectInProgress`; ``started`` past its lease, or ``unknown``, is never
repeated blindly: ``reconcile`` settles it, or a case is opened and `EffectAmbiguous` raised;
``failed`` (known not applied) runs again. More: docs/DESIGN.md."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from outbox.models import Effect, EffectState
from outbox.signals import effect_ambiguous

logger = logging.getLogger(__name__)

# Returned by a reconcile hook that looked and found the effect was not applied.
NOT_APPLIED = object()


class EffectError(Exception):
    """Base of the barrier's own errors."""


class EffectInProgress(EffectError):
    """Another worker holds this effect's live lease: try again later (transient)."""


class EffectAmbiguous(EffectError):
    """Nobody knows whether this effect applied; it is not repeated (a case is open)."""


class EffectFailed(Exception):
    """Raise from an effect to say it certainly did not apply (refused, never sent)."""


@dataclass
class EffectHandle:
    """What the body of `effect()` sees."""

    key: str
    done: bool = False
    result: Any = None
    external_id: str = ""
    _recorded: bool = field(default=False, repr=False)

    def record(self, *, result: Any = None, external_id: str = "") -> None:
        """Keep the effect's result (JSON) and the id the other system gave it."""
        self.result, self.external_id, self._recorded = result, external_id or "", True


def _worker() -> str:
    from core.workers import worker_id

    return worker_id()


def _default_lease() -> timedelta:
    from core.workers import claim_lease

    return claim_lease()


def renew_effect_leases(keys: list[str], *, worker: str, lease: timedelta) -> int:
    """started -> started with a fresh lease, for the effects this worker still runs (the
    lease keeper's tick, core/workers.py)."""
    return Effect.objects.filter(key__in=keys, state=EffectState.STARTED, lease_owner=worker).update(
        lease_expires_at=timezone.now() + lease
    )


def _acquire(key: str, *, worker: str, lease: timedelta, trace_id: str) -> Effect | None:
    """Take the effect's lease. None: it must not run now (the caller reads why)."""
    now = timezone.now()
    try:
        with transaction.atomic():
            return Effect.objects.create(
                key=key,
                state=EffectState.STARTED,
                lease_owner=worker,
                lease_expires_at=now + lease,
                attempts=1,
                trace_id=trace_id,
            )
    except IntegrityError:
        pass  # the key exists: decide by its state
    # failed -> started: a known failure may be retried; one conditional UPDATE decides
    # between two workers.
    n = Effect.objects.filter(key=key, state=EffectState.FAILED).update(
        state=EffectState.STARTED,
        lease_owner=worker,
        lease_expires_at=now + lease,
        attempts=F("attempts") + 1,
        updated_at=now,
    )
    if n == 1:
        return Effect.objects.get(key=key)
    return None


def _mark_unknown_if_abandoned(key: str) -> None:
    """started with an expired lease -> unknown: the runner died mid-effect."""
    now = timezone.now()
    Effect.objects.filter(key=key, state=EffectState.STARTED, lease_expires_at__lt=now).update(
        state=EffectState.UNKNOWN,
        last_error="the runner died or timed out while the effect was under way",
        lease_owner="",
        lease_expires_at=None,
        updated_at=now,
    )


def _finish(key: str, *, worker: str, state: str, **fields: Any) -> bool:
    now = timezone.now()
    if state == EffectState.DONE:
        fields["done_at"] = now
    n = Effect.objects.filter(key=key, state=EffectState.STARTED, lease_owner=worker).update(
        state=state, lease_owner="", lease_expires_at=None, updated_at=now, **fields
    )
    return n == 1


def effect_mark_done(key: str, *, result: Any = None, external_id: str = "", from_states: tuple[str, ...]) -> bool:
    """unknown|... -> done, by reconciliation (a lookup or an operator)."""
    now = timezone.now()
    n = Effect.objects.filter(key=key, state__in=from_states).update(
        state=EffectState.DONE,
        result=result,
        external_id=external_id[:255],
        lease_owner="",
        lease_expires_at=None,
        done_at=now,
        updated_at=now,
    )
    return n == 1


def effect_mark_not_applied(key: str, *, reason: str, from_states: tuple[str, ...]) -> bool:
    """unknown -> failed: known not to have applied, so the barrier lets it run again."""
    n = Effect.objects.filter(key=key, state__in=from_states).update(
        state=EffectState.FAILED,
        last_error=reason[:2000],
        lease_owner="",
        lease_expires_at=None,
        updated_at=timezone.now(),
    )
    return n == 1


def _reconcile_or_raise(effect: Effect, reconcile: Callable[[str], Any] | None) -> Any:
    """The effect is unknown. Settle it read-only, or open a case and refuse."""
    if reconcile is not None:
        try:
            found = reconcile(effect.key)
        except Exception as exc:  # noqa: BLE001 - a failed lookup settles nothing
            logger.warning("reconcile lookup for effect %s failed: %s", effect.key, exc)
        else:
            if found is NOT_APPLIED:
                effect_mark_not_applied(effect.key, reason="reconcile: not applied", from_states=(EffectState.UNKNOWN,))
                return NOT_APPLIED
            if found is not None:
                external_id = ""
                if isinstance(found, dict):
                    external_id = str(found.get("id") or found.get("external_id") or "")
                effect_mark_done(effect.key, result=found, external_id=external_id, from_states=(EffectState.UNKNOWN,))
                return found
    with transaction.atomic():
        effect_ambiguous.send(
            sender=Effect,
            effect=effect,
            facts={
                "attempts": effect.attempts,
                "last_error": effect.last_error[:500],
                "reconcile": "failed or none" if reconcile else "no lookup available",
                "at": timezone.now().isoformat(),
            },
        )
    raise EffectAmbiguous(f"effect {effect.key} may or may not have applied; it waits for reconciliation")


@contextmanager
def effect(
    key: str,
    *,
    trace_id: str = "",
    reconcile: Callable[[str], Any] | None = None,
    not_applied: tuple[type[BaseException], ...] = (),
    lease: timedelta | None = None,
) -> Iterator[EffectHandle]:
    """The barrier as a context manager. When ``handle.done`` is true the body must not act
    (the effect happened already; ``handle.result`` is its stored result)."""
    if not 1 <= len(key) <= 255:
        raise ValueError("an effect key is 1-255 characters")
    worker = _worker()
    handle = EffectHandle(key=key)
    row = _acquire(key, worker=worker, lease=lease or _default_lease(), trace_id=trace_id)
    while row is None:
        _mark_unknown_if_abandoned(key)
        existing = Effect.objects.filter(key=key).first()
        if existing is None:  # pruned meanwhile: start afresh
            row = _acquire(key, worker=worker, lease=lease or _default_lease(), trace_id=trace_id)
            continue
        if existing.state == EffectState.DONE:
            handle.done, handle.result, handle.external_id = True, existing.result, existing.external_id
            yield handle
            return
        if existing.state == EffectState.STARTED:
            raise EffectInProgress(f"effect {key} is under way in {existing.lease_owner or 'another worker'}")
        if existing.state == EffectState.UNKNOWN:
            settled = _reconcile_or_raise(existing, reconcile)
            if settled is not NOT_APPLIED:
                handle.done, handle.result = True, settled
                yield handle
                return
        # failed (or just found not applied): try to take it again.
        row = _acquire(key, worker=worker, lease=lease or _default_lease(), trace_id=trace_id)
        if row is None and Effect.objects.filter(key=key, state=EffectState.STARTED).exists():
            raise EffectInProgress(f"effect {key} was taken by another worker")

    from core.workers import lease_keeper

    # A lease the caller chose is its own to keep; the default one lives as long as the effect.
    keeping = lease_keeper.holding("effect", [key]) if lease is None else nullcontext()
    try:
        with keeping:
            yield handle
    except (EffectFailed, *not_applied) as exc:
        _finish(key, worker=worker, state=EffectState.FAILED, last_error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    except BaseException as exc:
        # The request may have left before the failure: never assume it did not apply.
        _finish(key, worker=worker, state=EffectState.UNKNOWN, last_error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    _finish(
        key,
        worker=worker,
        state=EffectState.DONE,
        result=handle.result,
        external_id=handle.external_id[:255],
        last_error="",
    )


def effect_run(
    key: str,
    fn: Callable[[EffectHandle], Any],
    *,
    trace_id: str = "",
    reconcile: Callable[[str], Any] | None = None,
    not_applied: tuple[type[BaseException], ...] = (),
    lease: timedelta | None = None,
) -> Any:
    """Run ``fn(handle)`` at most once per key and return its (stored) result.

    ``fn``'s return value is stored as the result (it must be JSON-serialisable); it may
    also call ``handle.record(result=..., external_id=...)``."""
    with effect(key, trace_id=trace_id, reconcile=reconcile, not_applied=not_applied, lease=lease) as handle:
        if handle.done:
            return handle.result
        value = fn(handle)
        if not handle._recorded:
            handle.record(result=value)
    return handle.result
