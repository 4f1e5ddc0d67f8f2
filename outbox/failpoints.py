"""Named crash points for the recovery tests (seed 004's four restart points).

`DOVECOTE_FAILPOINTS=after_claim` makes a worker SIGKILL itself at that point, as a
power cut would. Unset in production: then `failpoint()` is one dict lookup.
"""

import os
import signal

_ACTIVE = frozenset(filter(None, os.environ.get("DOVECOTE_FAILPOINTS", "").split(",")))


def failpoint(name: str) -> None:
    if name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
