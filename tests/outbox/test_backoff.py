"""The retry policy's bounds, for any attempt number and any settings (hypothesis): a retry
is never immediate, never later than the cap, and the ceiling grows exponentially."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox.policy import backoff_seconds

attempts = st.integers(min_value=1, max_value=200)
bases = st.floats(min_value=0.01, max_value=60, allow_nan=False, allow_infinity=False)
caps = st.floats(min_value=0.01, max_value=3600, allow_nan=False, allow_infinity=False)


@given(attempt=attempts, base=bases, cap=caps)
def test_a_backoff_is_never_immediate_and_never_past_its_ceiling(attempt: int, base: float, cap: float) -> None:
    delay = backoff_seconds(attempt, base=base, cap=cap)
    ceiling = min(cap, base * 2 ** (attempt - 1))
    assert delay >= base / 10
    assert delay <= max(ceiling, base / 10)


@given(attempt=st.integers(min_value=1, max_value=30), base=bases)
def test_the_ceiling_doubles_with_each_attempt_until_the_cap(attempt: int, base: float) -> None:
    cap = float("inf")
    # Full jitter: the largest of many draws approaches the ceiling, base * 2**(attempt-1).
    largest = max(backoff_seconds(attempt, base=base, cap=cap) for _ in range(400))
    assert base * 2 ** (attempt - 1) * 0.9 <= largest <= base * 2 ** (attempt - 1)
