"""The ids the project makes: trace ids sort by the time they were made, and none repeats."""

from __future__ import annotations

import re
import time

from core.ids import random_id, time_ordered_id

HEX32 = re.compile(r"[0-9a-f]{32}")


def test_a_time_ordered_id_is_32_hex_digits_led_by_the_milliseconds_it_was_made_at() -> None:
    before = time.time_ns() // 1_000_000
    made = time_ordered_id()
    after = time.time_ns() // 1_000_000

    assert HEX32.fullmatch(made)
    assert before <= int(made[:12], 16) <= after


def test_time_ordered_ids_made_a_millisecond_apart_sort_in_the_order_they_were_made() -> None:
    made = []
    for _ in range(20):
        made.append(time_ordered_id())
        time.sleep(0.0015)

    assert made == sorted(made)


def test_a_burst_of_ids_in_the_same_milliseconds_has_no_repeat() -> None:
    burst = [time_ordered_id() for _ in range(100_000)]
    randoms = [random_id() for _ in range(100_000)]

    assert len(set(burst)) == len(burst)
    assert len(set(randoms)) == len(randoms)
    assert all(HEX32.fullmatch(i) for i in burst[:100] + randoms[:100])
