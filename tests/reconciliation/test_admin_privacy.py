"""What an operator without `reconciliation.view_payload` sees of what people wrote and who
they are: nothing, on every page that shows an update or a message and in the dead-letter
export; an operator with it sees everything."""

from __future__ import annotations

import csv
import io
import itertools
import re
from dataclasses import dataclass

import pytest
from django.test import Client
from django.urls import reverse

from bots.inbox import inbox_update_store
from outbox.models import DeadLetter, ErrorClass, State
from tests.reconciliation.factories import message_row
from tests.reconciliation.telegram_updates import BODIES, sent_message, update_of
from tests.reconciliation.triage_helpers import failed_run, logged_in


def export(client: Client, *letters: DeadLetter) -> list[dict[str, str]]:
    response = client.post(
        reverse("admin:outbox_deadletter_changelist"),
        {"action": "export_csv", "_selected_action": [letter.pk for letter in letters]},
    )
    assert response.status_code == 200, response.content.decode()[:500]
    assert response["Content-Type"] == "text/csv"
    return list(csv.DictReader(io.StringIO(response.content.decode())))


CRM_ECHO = 'CRM rejected the event (422): {"name": "Alice Smith", "email": "alice@example.com"}'


def test_the_export_hides_what_the_detail_page_hides_of_a_last_error(bot, operator) -> None:
    letter = failed_run(bot, consumer="crm_webhook", error=CRM_ECHO)
    page = logged_in(operator).get(reverse("admin:outbox_deadletter_change", args=[letter.pk])).content.decode()
    assert "alice@example.com" not in page

    [row] = export(logged_in(operator), letter)

    assert row["id"] == str(letter.pk)
    assert "alice@example.com" not in row["last_error"]
    assert "Alice Smith" not in row["last_error"]
    assert "CRM rejected the event (422)" in row["last_error"]  # the error itself stays readable


def test_the_export_shows_a_last_error_in_full_with_payload_access(bot, developer) -> None:
    letter = failed_run(bot, consumer="crm_webhook", error=CRM_ECHO)

    [row] = export(logged_in(developer), letter)

    assert row["last_error"] == CRM_ECHO


def shows(page: str, value: str) -> bool:
    """`value` on the page as a value of its own, not inside a longer word or number."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", page) is not None


@dataclass
class Trail:
    """An update, a consumer run that failed on it and a reply that failed to go, each with
    its dead letter: the pages that show them and the user-supplied values in each."""

    pages: dict[str, str]
    letters: list[DeadLetter]
    in_update: list[str]
    in_reply: list[str]
    in_telegrams_result: list[str]

    @property
    def everything(self) -> list[str]:
        return [*self.in_update, *self.in_reply, *self.in_telegrams_result]


_update_ids = itertools.count(8_000_000)


def update_with_its_trail(bot, update_type: str) -> Trail:
    payload, in_update = update_of(update_type, next(_update_ids))
    update, _ = inbox_update_store(bot=bot, payload=payload)
    run_letter = failed_run(bot, update=update)
    reply_payload, in_reply, result, in_result = sent_message()
    reply = message_row(
        bot,
        key=f"reply:{update.update_id}",
        state=State.FAILED,
        payload=reply_payload,
        result=result,
        source_update=update,
        trace_id=update.trace_id,
    )
    reply_letter = DeadLetter.objects.create(
        bot=bot, message=reply, reason_class=ErrorClass.PERMANENT, trace_id=update.trace_id
    )
    pages = {
        "update": reverse("admin:bots_inboundupdate_change", args=[update.pk]),
        "consumer run": reverse("admin:bots_consumerrun_change", args=[run_letter.consumer_run_id]),
        "reply": reverse("admin:outbox_outboundmessage_change", args=[reply.pk]),
        "run's dead letter": reverse("admin:outbox_deadletter_change", args=[run_letter.pk]),
        "reply's dead letter": reverse("admin:outbox_deadletter_change", args=[reply_letter.pk]),
    }
    return Trail(pages, [run_letter, reply_letter], in_update, in_reply, in_result)


@pytest.mark.parametrize("update_type", list(BODIES))
def test_no_user_supplied_value_of_an_update_is_shown_without_payload_access(bot, operator, update_type) -> None:
    trail = update_with_its_trail(bot, update_type)
    client = logged_in(operator)

    for name, url in trail.pages.items():
        response = client.get(url)
        assert response.status_code == 200, name
        page = response.content.decode()
        assert "••• masked •••" in page or name == "consumer run", name
        assert [value for value in trail.everything if shows(page, value)] == [], name
    exported = "\n".join(str(row) for row in export(client, *trail.letters))
    assert [value for value in trail.everything if shows(exported, value)] == []


@pytest.mark.parametrize("update_type", list(BODIES))
def test_every_user_supplied_value_of_an_update_is_shown_with_payload_access(bot, developer, update_type) -> None:
    trail = update_with_its_trail(bot, update_type)
    client = logged_in(developer)

    for name, values in (
        ("update", trail.in_update),
        ("run's dead letter", [*trail.in_update, *trail.in_reply]),
        ("reply", [*trail.in_reply, *trail.in_telegrams_result]),
    ):
        page = client.get(trail.pages[name]).content.decode()
        assert [value for value in values if not shows(page, value)] == [], name
    exported = "\n".join(str(row) for row in export(client, *trail.letters))
    assert [value for value in trail.in_reply if not shows(exported, value)] == []


def test_payloads_read_as_pretty_json_on_every_page_masked_without_the_permission(bot, operator, developer) -> None:
    import html

    from reconciliation.models import ReconciliationCase
    from tests.reconciliation.triage_helpers import failed_row, logged_in

    payload = {"text": "Your order shipped", "disable_notification": True, "reply_markup": {"inline_keyboard": []}}
    letter = failed_row(bot, payload=payload)
    case = ReconciliationCase.objects.create(
        message_id=letter.message_id, idempotency_key=letter.idempotency_key
    )
    pages = [
        reverse("admin:outbox_deadletter_change", args=[letter.pk]),
        reverse("admin:reconciliation_reconciliationcase_change", args=[case.pk]),
    ]
    for url in pages:
        full = html.unescape(logged_in(developer).get(url).content.decode())
        assert '"disable_notification": true' in full, url
        assert '"text": "Your order shipped"' in full, url
        assert "'disable_notification': True" not in full, url

        masked = html.unescape(logged_in(operator).get(url).content.decode())
        assert '"text": "••• masked •••"' in masked, url
        assert "Your order shipped" not in masked, url
        assert "'text'" not in masked, url
