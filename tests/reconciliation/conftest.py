"""The operator personas the admin tests log in as."""

from __future__ import annotations

import pytest

from tests.reconciliation.triage_helpers import persona


@pytest.fixture
def operator(db: None):
    """Olga: the Operator group, which has no payload access."""
    return persona("olga", "Operator")


@pytest.fixture
def developer(db: None):
    """Dev: the Developer group, which sees payloads in full."""
    return persona("dev", "Developer")
