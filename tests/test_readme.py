"""The docs stay true to the code: every DOVECOTE_* setting the code reads is in the settings
table of docs/OPERATIONS.md and every setting in that table is one the code reads; the
README's consumer example is the code tests/bots/test_custom_consumer.py runs; the README
stays an introduction (at most 300 lines) whose links lead to files that exist."""

from __future__ import annotations

import re
import textwrap

from tests.support import ROOT

# Read by the test suite and the failpoint harness only, never by a deployment.
TEST_ONLY = {
    "DOVECOTE_FAILPOINTS",
    "DOVECOTE_TEST_RUN_ID",
    "DOVECOTE_FAULT_RESULTS_DIR",
    "DOVECOTE_TEST_SILENCED_CHECKS",
}
NAME = re.compile(r"\bDOVECOTE_[A-Z0-9_]+\b")
SETTINGS_TABLE = ROOT / "docs" / "OPERATIONS.md"


def read_by_the_code() -> set[str]:
    names: set[str] = set()
    for app in ("bots", "outbox", "reconciliation", "project"):
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" not in path.parts:
                names |= set(NAME.findall(path.read_text()))
    return names - TEST_ONLY


def in_the_settings_table() -> set[str]:
    rows = [line for line in SETTINGS_TABLE.read_text().splitlines() if line.startswith("| `")]
    # The first cell of a row names the setting(s): "| `A`, `B` | default | meaning |".
    return {name for row in rows for name in NAME.findall(row.split(" | ")[0])}


def test_every_dovecote_setting_the_code_reads_is_in_the_settings_table() -> None:
    assert sorted(read_by_the_code() - in_the_settings_table()) == []


def test_every_dovecote_setting_in_the_settings_table_is_read_by_the_code() -> None:
    assert sorted(in_the_settings_table() - read_by_the_code()) == []


def _code_lines(text: str) -> list[str]:
    return [line.rstrip() for line in textwrap.dedent(text).strip().splitlines() if line.strip()]


def test_the_readmes_consumer_example_is_the_code_the_test_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"```python\n# shop/consumers\.py\n(.*?)```", readme, re.DOTALL)
    assert shown, "the README shows shop/consumers.py"
    test = (ROOT / "tests" / "bots" / "test_custom_consumer.py").read_text()
    run = test.split("# --- from the README, verbatim")[1].split("\n", 1)[1].split("# --- end of the README example")[0]
    assert _code_lines(shown.group(1)) == _code_lines(run)


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    targets = re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not t.startswith(("http://", "https://", "mailto:"))]
    assert local, "the README links to the docs"
    assert [t for t in local if not (ROOT / t).exists()] == []


def test_every_test_the_docs_name_exists() -> None:
    named: set[tuple[str, str]] = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        named |= set(re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", doc.read_text()))
    assert named, "the docs name the tests that prove their promises"
    missing = [
        f"{path}::{name}"
        for path, name in sorted(named)
        if not (ROOT / path).exists()
        or not re.search(rf"^\s*def {name}\(", (ROOT / path).read_text(), re.MULTILINE)
    ]
    assert missing == []


def test_the_docs_links_lead_to_files_that_exist() -> None:
    broken = []
    for doc in [ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+?)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists():
                broken.append(f"{doc.name}: {target}")
    assert broken == []
