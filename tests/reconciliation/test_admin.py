"""The back office through Django's test client: Retry behind CSRF, a confirmation step and
a permission; masking without the payload permission; filters, search, counts; bulk action;
case decisions; read-only audit; token never shown; pause/resume; dashboard and /metrics."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from outbox.models import Circuit, CircuitState, DeadLetter, DeadLetterStatus, ErrorClass, State
from reconciliation.models import AuditEntry, BulkRetry, CaseStatus, Decision, ReconciliationCase
from tests.reconciliation.triage_helpers import failed_by_sandbox, failed_row, logged_in, message_of, persona
from tests.support import METRICS_AUTH

SECRET_TEXT = "Your card 4111 is blocked, Alice Smith"


@pytest.fixture
def viewer(db: None):
    """Staff who can look at dead letters but holds no operator permission."""
    from django.contrib.auth.models import Permission

    user = persona("victor")
    user.user_permissions.add(Permission.objects.get(codename="view_deadletter"))
    return user


def retry_url(letter: DeadLetter) -> str:
    return reverse("admin:outbox_deadletter_retry", args=[letter.pk])


def change_url(letter: DeadLetter) -> str:
    return reverse("admin:outbox_deadletter_change", args=[letter.pk])


def test_the_groups_are_created_by_the_migration(db: None) -> None:
    operator = set(Group.objects.get(name="Operator").permissions.values_list("codename", flat=True))
    developer = set(Group.objects.get(name="Developer").permissions.values_list("codename", flat=True))
    assert {"retry_deadletter", "resolve_deadletter", "decide_case", "view_deadletter"} <= operator
    assert "view_payload" not in operator
    assert developer - operator == {"view_payload", "add_bot", "change_bot"}


def test_the_detail_page_shows_a_retry_button_to_an_operator_and_none_without_the_permission(
    bot, operator, viewer
) -> None:
    letter = failed_row(bot)
    page = logged_in(operator).get(change_url(letter))
    assert page.status_code == 200
    assert retry_url(letter) in page.content.decode()

    page = logged_in(viewer).get(change_url(letter))
    assert page.status_code == 200
    assert retry_url(letter) not in page.content.decode()


def test_a_get_on_retry_only_shows_the_confirmation(bot, operator) -> None:
    letter = failed_row(bot)
    page = logged_in(operator).get(retry_url(letter))
    assert page.status_code == 200
    assert "csrfmiddlewaretoken" in page.content.decode()
    assert message_of(letter).state == State.FAILED
    assert not AuditEntry.objects.exists()


def test_a_post_without_the_csrf_token_is_rejected(bot, operator) -> None:
    letter = failed_row(bot)
    response = logged_in(operator, csrf=True).post(retry_url(letter), {"reason": "retry"})
    assert response.status_code == 403
    assert message_of(letter).state == State.FAILED


def test_a_user_without_the_retry_permission_cannot_retry(bot, viewer) -> None:
    letter = failed_row(bot)
    response = logged_in(viewer).post(retry_url(letter), {"reason": "retry"})
    assert response.status_code == 403
    assert message_of(letter).state == State.FAILED
    assert not AuditEntry.objects.exists()


def test_an_anonymous_post_is_sent_to_the_login_page(bot) -> None:
    letter = failed_row(bot)
    response = Client().post(retry_url(letter), {"reason": "retry"})
    assert response.status_code == 302
    assert "/login/" in response["Location"]
    assert message_of(letter).state == State.FAILED


def test_retry_needs_a_reason(bot, operator) -> None:
    letter = failed_row(bot)
    page = logged_in(operator).post(retry_url(letter), {"reason": ""})
    assert page.status_code == 200
    assert "This field is required" in page.content.decode()
    assert message_of(letter).state == State.FAILED


def test_retry_with_a_reason_requeues_the_same_key_and_is_logged_and_audited(sandbox, bot, operator) -> None:
    letter = failed_by_sandbox(sandbox, bot)
    key = message_of(letter).idempotency_key
    client = logged_in(operator, csrf=True)
    confirm = client.get(retry_url(letter))
    token = confirm.context["csrf_token"]

    response = client.post(retry_url(letter), {"reason": "user unblocked us", "csrfmiddlewaretoken": str(token)})

    assert response.status_code == 302
    assert response["Location"] == change_url(letter)
    message = message_of(letter)
    assert (message.state, message.idempotency_key) == (State.RETRY, key)
    assert DeadLetter.objects.get(pk=letter.pk).status == DeadLetterStatus.REQUEUED
    audit = AuditEntry.objects.get(action="deadletter.retry")
    assert (audit.actor, audit.reason) == (operator, "user unblocked us")
    assert LogEntry.objects.filter(user=operator, object_id=str(letter.pk)).exists()
    page = client.get(change_url(letter))
    assert "requeued" in page.content.decode()


def test_retry_of_a_delivered_key_is_refused_with_the_reason_shown(bot, operator) -> None:
    letter = failed_row(bot)
    type(message_of(letter)).objects.filter(pk=letter.message_id).update(state=State.SENT, sent_at=timezone.now())
    client = logged_in(operator)

    response = client.post(retry_url(letter), {"reason": "again"}, follow=True)

    text = response.content.decode()
    assert "refused: already delivered" in text
    assert DeadLetter.objects.get(pk=letter.pk).status == DeadLetterStatus.OPEN


def test_payload_and_personal_fields_are_masked_without_the_payload_permission(
    sandbox, bot, operator, developer
) -> None:
    letter = failed_by_sandbox(sandbox, bot, text=SECRET_TEXT)
    pages = [
        change_url(letter),
        reverse("admin:outbox_outboundmessage_change", args=[letter.message_id]),
        retry_url(letter),
    ]
    for url in pages:
        assert SECRET_TEXT not in logged_in(operator).get(url).content.decode(), url
    export = logged_in(operator).post(
        reverse("admin:outbox_deadletter_changelist"), {"action": "export_csv", "_selected_action": [letter.pk]}
    )
    assert export.status_code == 200
    assert SECRET_TEXT not in export.content.decode()
    assert "masked" in export.content.decode()

    assert SECRET_TEXT in logged_in(developer).get(change_url(letter)).content.decode()


def test_the_update_payload_masks_names_and_usernames(bot, operator, developer) -> None:
    from tests.reconciliation.factories import stored_update

    update = stored_update(bot, text="call me at +44 7700 900123")
    url = reverse("admin:bots_inboundupdate_change", args=[update.pk])
    assert "Alice" not in logged_in(operator).get(url).content.decode()
    assert "7700" not in logged_in(operator).get(url).content.decode()
    assert "Alice" in logged_in(developer).get(url).content.decode()


def _nest(depth: int, bottom: dict) -> dict:
    """`bottom` inside `depth - 1` objects, built without recursion."""
    value = bottom
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("depth", [64, 500])
def test_an_update_payload_of_any_stored_depth_renders_masked_and_in_full(bot, operator, developer, depth) -> None:
    from bots.models import ConsumerRun, InboundUpdate
    from tests.reconciliation.factories import stored_update

    # 64 levels: as deep as the webhook accepts. 500: stored another way (a shell, the poller).
    update = stored_update(bot)
    bottom = {"bottom_note": "TheBottomLevel", "first_name": "Alice"}
    InboundUpdate.objects.filter(pk=update.pk).update(payload={**update.payload, "deep": _nest(depth - 1, bottom)})
    run = ConsumerRun.objects.create(
        update=update, bot=bot, consumer="auto_reply", state="failed", next_attempt_at=timezone.now()
    )
    letter = DeadLetter.objects.create(bot=bot, consumer_run=run, consumer="auto_reply", reason_class="permanent")

    for url in (reverse("admin:bots_inboundupdate_change", args=[update.pk]), change_url(letter)):
        shown, masked = logged_in(developer).get(url), logged_in(operator).get(url)

        assert shown.status_code == masked.status_code == 200, url
        assert "Alice" not in masked.content.decode()
        if depth <= 64:
            assert "TheBottomLevel" in shown.content.decode()
            # Down to the bottom level, its value masked: a field nobody listed is masked.
            assert "bottom_note" in masked.content.decode()
            assert "TheBottomLevel" not in masked.content.decode()
            assert "not shown" not in shown.content.decode()
        else:
            # pprint (the dead letter's story) wraps long strings at their spaces: word by word.
            for page in (shown, masked):
                assert all(word in page.content.decode() for word in ("deeper", "64", "levels,", "shown"))
                assert "TheBottomLevel" not in page.content.decode()


def test_the_changelist_filters_by_reason_and_age_shows_counts_and_searches(bot, operator) -> None:
    recent = failed_row(bot, reason_class=ErrorClass.PERMANENT, chat_id=9001)
    old = failed_row(bot, reason_class=ErrorClass.EXHAUSTED)
    DeadLetter.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=9))
    client = logged_in(operator)
    url = reverse("admin:outbox_deadletter_changelist")

    page = client.get(url)
    assert page.status_code == 200
    assert [x.pk for x in page.context["cl"].result_list] == [recent.pk, old.pk]  # newest first
    assert {r["reason"]: r["n"] for r in page.context["reason_counts"]} == {"permanent": 1, "exhausted": 1}

    assert [x.pk for x in client.get(url, {"reason_class__exact": "permanent"}).context["cl"].result_list] == [
        recent.pk
    ]
    assert [x.pk for x in client.get(url, {"age": "older"}).context["cl"].result_list] == [old.pk]
    assert [x.pk for x in client.get(url, {"age": "1h"}).context["cl"].result_list] == [recent.pk]
    for term in ("9001", recent.trace_id, recent.idempotency_key):
        assert [x.pk for x in client.get(url, {"q": term}).context["cl"].result_list] == [recent.pk], term
    assert client.get(url, {"q": "no-such-thing"}).context["cl"].result_count == 0


def test_bulk_retry_action_asks_for_a_reason_then_starts_a_batched_release(bot, operator) -> None:
    letters = [failed_row(bot) for _ in range(12)]
    client = logged_in(operator)
    url = reverse("admin:outbox_deadletter_changelist")
    selected = [x.pk for x in letters]

    confirm = client.post(url, {"action": "bulk_retry_action", "_selected_action": selected})
    assert confirm.status_code == 200
    assert "Start bulk retry" in confirm.content.decode()
    assert not BulkRetry.objects.exists()

    response = client.post(
        url, {"action": "bulk_retry_action", "_selected_action": selected, "confirm": "yes", "reason": "502s over"}
    )
    bulk = BulkRetry.objects.get()
    assert response.status_code == 302
    assert (bulk.total, bulk.first_batch, bulk.created_by, bulk.reason) == (12, 10, operator, "502s over")
    summary = client.get(reverse("admin:reconciliation_bulkretry_change", args=[bulk.pk]))
    assert "0 of 12 checked" in summary.content.decode()


def test_bulk_retry_needs_the_retry_permission(bot, viewer) -> None:
    from django.contrib.auth.models import Permission

    viewer.user_permissions.add(Permission.objects.get(codename="change_deadletter"))
    letter = failed_row(bot)
    response = logged_in(viewer).post(
        reverse("admin:outbox_deadletter_changelist"),
        {"action": "bulk_retry_action", "_selected_action": [letter.pk], "confirm": "yes", "reason": "x"},
    )
    assert response.status_code in (302, 403)
    assert not BulkRetry.objects.exists()


def test_resolve_and_discard_go_through_a_confirmation_and_are_audited(bot, operator) -> None:
    first, second = failed_row(bot), failed_row(bot)
    client = logged_in(operator)
    client.post(reverse("admin:outbox_deadletter_resolve", args=[first.pk]), {"reason": "done by phone"})
    client.post(reverse("admin:outbox_deadletter_discard", args=[second.pk]), {"reason": "test data"})
    assert DeadLetter.objects.get(pk=first.pk).status == DeadLetterStatus.RESOLVED
    assert DeadLetter.objects.get(pk=second.pk).status == DeadLetterStatus.DISCARDED
    assert set(AuditEntry.objects.values_list("action", flat=True)) == {"deadletter.resolve", "deadletter.discard"}


def test_assigning_an_owner_on_the_detail_page_is_audited(bot, operator) -> None:
    letter = failed_row(bot)
    response = logged_in(operator).post(change_url(letter), {"owner": operator.pk})
    assert response.status_code == 302
    assert DeadLetter.objects.get(pk=letter.pk).owner == operator
    assert AuditEntry.objects.get(action="deadletter.assign").outcome == "owner - -> olga"


def test_an_open_case_is_marked_delivered_with_a_telegram_message_id(bot, operator) -> None:
    from tests.reconciliation.factories import message_row

    message = message_row(bot, key="pay:1", state=State.UNKNOWN)
    case = ReconciliationCase.objects.create(message=message, idempotency_key="pay:1")
    client = logged_in(operator)
    url = reverse("admin:reconciliation_case_decide", args=[case.pk, "mark_delivered"])
    assert url in client.get(reverse("admin:reconciliation_reconciliationcase_change", args=[case.pk])).content.decode()

    client.post(url, {"reason": "seen in the chat", "telegram_message_id": "555"})

    case.refresh_from_db()
    assert (case.status, case.decision, case.decided_by) == (CaseStatus.RESOLVED, Decision.MARK_DELIVERED, operator)
    message.refresh_from_db()
    assert (message.state, message.telegram_message_id) == (State.SENT, 555)
    assert AuditEntry.objects.filter(action="reconciliation.mark_delivered", actor=operator).exists()


def test_a_case_decided_twice_is_refused_the_second_time(bot, operator) -> None:
    from tests.reconciliation.factories import message_row

    message = message_row(bot, key="pay:2", state=State.UNKNOWN)
    case = ReconciliationCase.objects.create(message=message, idempotency_key="pay:2")
    client = logged_in(operator)
    client.post(reverse("admin:reconciliation_case_decide", args=[case.pk, "cancel"]), {"reason": "not needed"})
    response = client.post(
        reverse("admin:reconciliation_case_decide", args=[case.pk, "resend"]), {"reason": "oops"}, follow=True
    )
    assert "Nothing done" in response.content.decode()
    assert message_of_case(case).state == State.CANCELLED


def message_of_case(case: ReconciliationCase):
    case.refresh_from_db()
    return case.message


def test_audit_rows_are_read_only(bot, developer) -> None:
    superuser = persona("root", superuser=True)
    entry = AuditEntry.objects.create(actor=developer, action="deadletter.retry", target="x", reason="r")
    client = logged_in(superuser)
    assert client.get(reverse("admin:reconciliation_auditentry_add")).status_code == 403
    page = client.post(reverse("admin:reconciliation_auditentry_change", args=[entry.pk]), {"reason": "rewritten"})
    assert page.status_code == 403
    delete = client.post(reverse("admin:reconciliation_auditentry_delete", args=[entry.pk]), {"post": "yes"})
    assert delete.status_code == 403
    entry.refresh_from_db()
    assert entry.reason == "r"


def test_a_bot_token_is_never_shown_and_pause_resume_are_audited(bot, developer) -> None:
    client = logged_in(developer)
    page = client.get(reverse("admin:bots_bot_change", args=[bot.pk]))
    assert bot.token not in page.content.decode()
    pause = reverse("dovecote_circuit", args=["pause"]) + f"?scope=bot:{bot.pk}"
    assert pause.split("?")[0] in page.content.decode()

    assert client.get(pause).status_code == 200  # the confirmation only
    assert not Circuit.objects.filter(scope=f"bot:{bot.pk}").exists()
    client.post(pause, {"reason": "Telegram incident"})
    assert Circuit.objects.get(scope=f"bot:{bot.pk}").state == CircuitState.OPEN
    client.post(reverse("dovecote_circuit", args=["resume"]) + f"?scope=bot:{bot.pk}", {"reason": "over"})
    assert Circuit.objects.get(scope=f"bot:{bot.pk}").state == CircuitState.CLOSED
    assert list(AuditEntry.objects.order_by("pk").values_list("action", flat=True)) == [
        "circuit.pause",
        "circuit.resume",
    ]


@pytest.mark.parametrize("scope", ["bot:", "bot:x", "bot:999999", "consumer:", "crm", ""])
def test_pausing_a_scope_that_names_no_bot_or_consumer_is_a_404(bot, developer, scope) -> None:
    client = logged_in(developer)
    url = reverse("dovecote_circuit", args=["pause"])
    assert client.post(url + f"?scope={scope}", {"reason": "typo"}).status_code == 404
    assert not Circuit.objects.exists()


def test_the_dashboard_renders_charts_a_live_fragment_and_json(sandbox, bot, operator, viewer) -> None:
    failed_by_sandbox(sandbox, bot)
    client = logged_in(operator)
    page = client.get(reverse("dovecote_dashboard"))
    assert page.status_code == 200
    text = page.content.decode()
    assert "<svg" in text
    assert "dashboard.js" in text
    fragment = client.get(reverse("dovecote_dashboard_fragment"), {"bot": bot.pk})
    assert fragment.status_code == 200
    assert "<html" not in fragment.content.decode()
    data = client.get(reverse("dovecote_dashboard_data")).json()
    assert data["dead_letters_by_reason"] == {"permanent": 1}
    # The backlog is unfinished work only (bounded queries); the failure shows as a dead
    # letter and in the failed share.
    assert data["backlog"]["outbox"] == {"pending": 0, "retry": 0, "sending": 0, "unknown": 0}
    assert data["failed_share"]["failed"] == 1
    assert data["failed_share"]["share"] == 1.0
    assert logged_in(viewer).get(reverse("dovecote_dashboard")).status_code == 403
    assert reverse("dovecote_dashboard") in client.get(reverse("admin:index")).content.decode()


def test_a_dashboard_refresh_costs_the_same_queries_with_more_history(sandbox, bot, operator) -> None:
    """No full-table aggregation per refresh: the number of queries does not grow with the
    rows, and none groups attempts by day."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from reconciliation.dashboard import dashboard_numbers

    failed_by_sandbox(sandbox, bot)
    with CaptureQueriesContext(connection) as queries:
        dashboard_numbers(bot.pk)
    assert not any("outbox_attempt" in q["sql"] and "GROUP BY" in q["sql"] for q in queries.captured_queries)
    assert all("WHERE" in q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"])


def test_metrics_export_the_dashboard_numbers_and_keep_the_old_names(sandbox, bot) -> None:
    failed_by_sandbox(sandbox, bot)
    text = Client().get("/metrics", headers=METRICS_AUTH).content.decode()
    for name in (
        "dovecote_outbox_items",
        "dovecote_dead_letters_open",
        "dovecote_reconciliation_cases_open",
        "dovecote_circuit_paused",
        "dovecote_bot_outbox_items",
        "dovecote_oldest_waiting_seconds",
        "dovecote_sweeper_last_run_timestamp_seconds",
    ):
        assert f"# TYPE {name} gauge" in text, name
    # What happened is counted (rate() works on it), no longer a gauge of rows.
    assert "# TYPE dovecote_sends_total counter" in text
    assert "# TYPE dovecote_reply_latency_seconds histogram" in text
    assert f'dovecote_bot_dead_letters_open{{bot="{bot.name}",reason="permanent"}} 1.0' in text
    # Series that grew without bound are gone.
    assert "dovecote_retries_per_day" not in text
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))


def test_a_view_only_operator_sees_neither_the_token_nor_the_webhook_secret(bot_factory) -> None:
    """Found from outside: Django renders every field of a read-only page, token included."""
    from django.contrib.auth.models import Permission

    bot = bot_factory(webhook_secret="wh-secret-value-123")
    viewer = persona("vera")
    viewer.user_permissions.add(Permission.objects.get(codename="view_bot"))

    page = logged_in(viewer).get(reverse("admin:bots_bot_change", args=[bot.pk]))

    assert page.status_code == 200
    text = page.content.decode()
    assert bot.token not in text
    assert bot.token.split(":")[1] not in text
    assert "wh-secret-value-123" not in text
    assert f"{bot.token.split(':')[0]}:…{bot.token[-2:]}" in text  # the hint
    assert "set (19 characters)" in text


def test_credentials_are_write_only_and_their_change_is_audited_without_the_value(bot_factory) -> None:
    bot = bot_factory(webhook_secret="old-secret")
    admin_user = persona("root", superuser=True)
    client = logged_in(admin_user)
    url = reverse("admin:bots_bot_change", args=[bot.pk])

    page = client.get(url).content.decode()
    assert bot.token not in page
    assert "old-secret" not in page

    form = {
        "name": bot.name,
        "token": "",  # left empty: kept
        "webhook_secret": "new-secret",
        "api_base_url": bot.api_base_url,
        "is_active": "on",
        "responder": bot.responder,
        "rate_limit": bot.rate_limit,
        "openai_model": "",
        "system_prompt": "",
    }
    response = client.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]

    bot_after = type(bot).objects.get(pk=bot.pk)
    assert (bot_after.token, bot_after.webhook_secret) == (bot.token, "new-secret")
    [entry] = AuditEntry.objects.filter(action="bot.credentials_changed")
    assert (entry.actor, entry.details) == (admin_user, {"fields": ["webhook_secret"]})
    assert "new-secret" not in str(entry.__dict__)


def test_circuits_change_only_through_pause_and_resume(bot, developer) -> None:
    from outbox import circuits

    circuits.open_for_auth(f"bot:{bot.pk}", reason="401")
    circuit = Circuit.objects.get(scope=f"bot:{bot.pk}")
    client = logged_in(persona("root", superuser=True))
    url = reverse("admin:outbox_circuit_change", args=[circuit.pk])

    client.post(url, {"scope": circuit.scope, "state": "closed", "reason": "", "manual": ""})

    assert Circuit.objects.get(pk=circuit.pk).state == CircuitState.OPEN
    assert client.get(url).status_code == 200  # still visible, read-only


def test_error_texts_that_echo_a_crm_body_are_redacted_without_payload_access(bot, operator, developer) -> None:
    """Found from outside: payloads were masked, but a CRM's error echoing the lead was not."""
    from bots.models import ConsumerRun, RunState
    from tests.reconciliation.factories import stored_update

    echoed = 'CRM 422: {"name": "Alice Smith", "phone": "+7 912 345-67-89", "email": "alice@example.com"}'
    update = stored_update(bot)
    run = ConsumerRun.objects.create(
        update=update,
        bot=bot,
        consumer="crm_webhook",
        state=RunState.FAILED,
        last_error=echoed,
        next_attempt_at=timezone.now(),
    )
    letter = DeadLetter.objects.create(
        bot=bot,
        consumer_run=run,
        consumer="crm_webhook",
        reason_class=ErrorClass.PERMANENT,
        first_error=echoed,
        last_error=echoed,
    )
    pages = [
        change_url(letter),
        reverse("admin:outbox_deadletter_changelist"),
        reverse("admin:bots_consumerrun_change", args=[run.pk]),
    ]

    for url in pages:
        text = logged_in(operator).get(url).content.decode()
        assert "+7 912" not in text, url
        assert "alice@example.com" not in text, url
        assert "Alice Smith" not in text, url
    full = logged_in(developer).get(change_url(letter)).content.decode()
    assert "alice@example.com" in full


def test_a_dead_letter_is_assigned_to_staff_operators_only_never_an_api_client(bot, operator) -> None:
    from outbox.services import api_client_add

    client_user = api_client_add(name="crm-client", bot_names=[bot.name])[0].user
    gone = persona("gina")
    gone.is_active = False
    gone.save(update_fields=["is_active"])
    letter = failed_row(bot)
    admin = logged_in(operator)

    page = admin.get(change_url(letter)).content.decode()
    assert f'<option value="{operator.pk}">olga</option>' in page
    assert "crm-client" not in page
    assert "gina" not in page

    refused = admin.post(change_url(letter), {"owner": client_user.pk})
    assert refused.status_code == 200  # the form again, with its error
    assert "Select a valid choice" in refused.content.decode()
    letter.refresh_from_db()
    assert letter.owner_id is None

    assert admin.post(change_url(letter), {"owner": operator.pk}).status_code == 302
    letter.refresh_from_db()
    assert letter.owner_id == operator.pk

    changelist = reverse("admin:outbox_deadletter_changelist")
    listed = admin.get(changelist).content.decode()
    assert f"?owner={operator.pk}" in listed
    assert f"?owner={client_user.pk}" not in listed
    assert admin.get(changelist, {"owner": operator.pk}).context["cl"].result_count == 1
    assert admin.get(changelist, {"owner": "none"}).context["cl"].result_count == 0
    assert admin.get(changelist, {"owner": "olga"}).status_code == 200  # not an id: no filter, no 500
