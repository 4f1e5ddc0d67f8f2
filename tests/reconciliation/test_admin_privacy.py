"""What an operator without `reconciliation.view_payload` sees of what people wrote and who
they are: nothing, on every page that shows an update or a message and in the dead-letter
export; an operator with it sees everything."""

from __future__ import annotations

import csv
import io

from django.test import Client
from django.urls import reverse

from outbox.models import DeadLetter
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
