"""The README stays true to the code: every DOVECOTE_* setting the code reads is in its
settings table, and every setting in the table is one the code reads."""

from __future__ import annotations

import re

from tests.support import ROOT

# Read by the test suite and the failpoint harness only, never by a deployment.
TEST_ONLY = {
    "DOVECOTE_FAILPOINTS",
    "DOVECOTE_TEST_RUN_ID",
    "DOVECOTE_FAULT_RESULTS_DIR",
    "DOVECOTE_TEST_SILENCED_CHECKS",
}
NAME = re.compile(r"\bDOVECOTE_[A-Z0-9_]+\b")


def read_by_the_code() -> set[str]:
    names: set[str] = set()
    for app in ("bots", "outbox", "reconciliation", "project"):
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" not in path.parts:
                names |= set(NAME.findall(path.read_text()))
    return names - TEST_ONLY


def in_the_readme_table() -> set[str]:
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    # The first cell of a row names the setting(s): "| `A`, `B` | default | meaning |".
    return {name for row in rows for name in NAME.findall(row.split(" | ")[0])}


def test_every_dovecote_setting_the_code_reads_is_in_the_readme_table() -> None:
    assert sorted(read_by_the_code() - in_the_readme_table()) == []


def test_every_dovecote_setting_in_the_readme_table_is_read_by_the_code() -> None:
    assert sorted(in_the_readme_table() - read_by_the_code()) == []
