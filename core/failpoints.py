"""Named crash points for the recovery tests (seed 004's four restart points).

`DOVECOTE_FAILPOINTS=after_claim` makes a worker SIGKILL itself at that point, as a
power cut would. Unset in production: then `failpoint()` is one dict lookup.

The points, in the order a send passes them (tests/e2e/test_restart_points.py):
`before_claim_commit` (the claim's UPDATE ran, its COMMIT did not), `after_claim`,
`before_request` (the attempt row is committed, no request yet), `after_response` (an
answer is in, not recorded), `after_record` (the outcome is committed). And one of the
router's: `after_inline_runs` (the first consumer's inline runs of a batch claimed and
run, their replies committed, nothing sent and no run marked done).
"""

import contextlib
import os
import signal
from typing import Any

_ACTIVE = frozenset(filter(None, os.environ.get("DOVECOTE_FAILPOINTS", "").split(",")))


def failpoint(name: str) -> None:
    if name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)


def uncommitted(name: str) -> contextlib.AbstractContextManager[Any]:
    """Around a statement that autocommit commits by itself, for a failpoint between the
    statement and its commit: with `name` armed, an explicit transaction (the worker dies
    inside it); otherwise nothing, so production pays no BEGIN/COMMIT round trips for it."""
    if name in _ACTIVE:
        from django.db import transaction

        return transaction.atomic()
    return contextlib.nullcontext()
