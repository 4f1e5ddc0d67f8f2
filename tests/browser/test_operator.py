"""An operator's day in a real browser (Playwright driving Debian's Chromium against
pytest-django's live server): filter dead letters by reason, open one, Retry with a reason,
see it requeued and audited; a user without the permission sees no Retry button. Saves a
screenshot of the dashboard (docs/dashboard.png when missing or DOVECOTE_UPDATE_SCREENSHOTS=1)."""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connections
from django.utils import timezone

from outbox import circuits
from outbox.models import Attempt, DeadLetter, DeadLetterStatus, ErrorClass, OutboundMessage, State
from reconciliation.models import AuditEntry
from tests.reconciliation.factories import message_row, stored_update
from tests.reconciliation.triage_helpers import failed_row, persona
from tests.support import require_tool

pytestmark = [pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"


@pytest.fixture
def page(monkeypatch):
    # Playwright's sync API keeps an event loop in this thread; the test's own ORM calls are
    # ordinary synchronous ones, so Django's async guard is lifted for this test only.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    try:
        from playwright import sync_api
    except ImportError:
        sync_api = None
    require_tool("playwright", sync_api, install="`make test` installs requirements-dev.txt")
    require_tool("chromium", os.path.exists(CHROMIUM), install="`make services` installs Debian's chromium")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.set_default_timeout(15_000)
        yield context.new_page()
        context.close()
        browser.close()
        # The ORM calls made while Playwright's loop ran used a connection of their own.
        connections.close_all()


def log_in(page, base: str, username: str) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", username)
    page.fill("#id_password", username)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base}/admin/")


def test_an_operator_filters_opens_and_retries_a_dead_letter(live_server, page, bot_factory) -> None:
    bot = bot_factory(name="shop")
    persona("olga", "Operator")
    persona("victor")  # staff, no operator rights
    target = failed_row(bot, reason_class=ErrorClass.PERMANENT, chat_id=777)
    failed_row(bot, reason_class=ErrorClass.EXHAUSTED)
    base = live_server.url

    log_in(page, base, "olga")
    page.goto(f"{base}/admin/outbox/deadletter/")
    assert "Open by reason" in page.inner_text("#reason-counts")
    page.click("#reason-counts a.dovecote-reason-permanent")
    page.wait_for_url("**reason_class__exact=permanent**")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1
    rows.first.locator("th a").click()
    page.wait_for_url(f"**/admin/outbox/deadletter/{target.pk}/change/**")

    page.click("#retry-button")
    page.fill("#id_reason", "the user unblocked the bot")
    page.click("input[name=_confirm]")
    page.wait_for_url(f"**/admin/outbox/deadletter/{target.pk}/change/")
    assert "requeued" in page.inner_text("ul.messagelist")
    assert "the user unblocked the bot" in page.inner_text("#story-audit")
    assert page.locator("#retry-button").count() == 0  # not open any more

    message = OutboundMessage.objects.get(pk=target.message_id)
    assert (message.state, message.idempotency_key) == (State.RETRY, target.idempotency_key)
    assert DeadLetter.objects.get(pk=target.pk).status == DeadLetterStatus.REQUEUED
    assert AuditEntry.objects.get(action="deadletter.retry").actor.username == "olga"

    # Someone without the retry permission sees the dead letter but no Retry button.
    other = DeadLetter.objects.exclude(pk=target.pk).get()
    page.context.clear_cookies()
    from django.contrib.auth.models import Permission, User

    User.objects.get(username="victor").user_permissions.add(Permission.objects.get(codename="view_deadletter"))
    log_in(page, base, "victor")
    page.goto(f"{base}/admin/outbox/deadletter/{other.pk}/change/")
    assert page.locator("#retry-button").count() == 0
    assert "dead letter" in page.content().lower()


def _demo_traffic(bot_factory) -> None:
    """A little of everything, so the dashboard has something to show."""
    now = timezone.now()
    shop, news = bot_factory(name="shop"), bot_factory(name="news", rate_limit=10)
    for i in range(24):
        update = stored_update(shop, chat_id=5000 + i)
        received = now - timedelta(minutes=50 - 2 * i)
        type(update).objects.filter(pk=update.pk).update(received_at=received)
        message_row(
            shop,
            key=f"reply:{i}",
            state=State.SENT,
            source_update=update,
            sent_at=received + timedelta(seconds=0.4 + (i % 7) * 0.35 + (3.5 if i % 11 == 0 else 0)),
        )
    for i in range(6):
        message_row(shop, key=f"waiting:{i}", state=State.PENDING if i % 2 else State.RETRY)
    for i, reason in enumerate([ErrorClass.PERMANENT] * 3 + [ErrorClass.EXHAUSTED] * 5 + [ErrorClass.AUTH] * 2):
        failed_row(news if i % 3 == 0 else shop, reason_class=reason)
    for day in range(7):
        message = message_row(news, key=f"retried:{day}", state=State.SENT, sent_at=now)
        for n in range(2, 2 + (day * 3) % 8 + 1):
            Attempt.objects.create(message=message, number=n, started_at=now - timedelta(days=day), outcome="ok")
    circuits.pause(f"bot:{news.pk}", reason="paused by olga: Telegram incident")


def test_the_dashboard_refreshes_itself_and_is_captured(live_server, page, bot_factory) -> None:
    _demo_traffic(bot_factory)
    persona("olga", "Operator")
    base = live_server.url
    log_in(page, base, "olga")
    assert page.locator("#dovecote-ops a", has_text="Dashboard").count() == 1
    page.click("#dovecote-ops a:has-text('Dashboard')")
    page.wait_for_url("**/admin/ops/dashboard/")
    assert page.locator("#dashboard-body svg").count() >= 4
    assert page.inner_text("#tile-dead").strip() == "10"

    # One more dead letter appears; the page shows it without a reload.
    failed_row(type(DeadLetter.objects.first().bot).objects.get(name="shop"), reason_class=ErrorClass.PERMANENT)
    page.wait_for_function("document.getElementById('tile-dead').innerText.trim() === '11'", timeout=12_000)
    assert "updated" in page.inner_text("#dashboard-updated")

    shot = Path(tempfile.mkdtemp()) / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if not SCREENSHOT.exists() or os.environ.get("DOVECOTE_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copy(shot, SCREENSHOT)
