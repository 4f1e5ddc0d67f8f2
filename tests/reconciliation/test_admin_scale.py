"""The changelists of the big tables stay index-friendly: fixed filter choices (no SELECT
DISTINCT per page), no date_hierarchy (no DATE_TRUNC), exact searches (no UPPER(...) or
LIKE), no full count under the results."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from bots.models import AnalyticsEvent, ConsumerRun, InboundUpdate
from outbox.models import DeadLetter, OutboundMessage
from tests.reconciliation.factories import message_row, stored_update

SLOW = re.compile(r"\bDISTINCT\b|DATE_TRUNC|UPPER\(|\bLIKE\b", re.IGNORECASE)

# (model, filters to try, a search term): each filter the issue names, on its changelist.
PAGES = [
    (OutboundMessage, ["method=sendMessage", "last_error_class=transient", "state=pending"], "trace-abc"),
    (ConsumerRun, ["consumer=auto_reply", "last_error_class=permanent"], "trace-abc"),
    (InboundUpdate, ["update_type=message", "state=new"], "trace-abc"),
    (DeadLetter, ["consumer=auto_reply", "reason_class=permanent"], "trace-abc"),
    (AnalyticsEvent, ["update_type=message", "chat_type=private"], "4242"),
]


@pytest.fixture
def admin_client_(db: None) -> Client:
    user = get_user_model().objects.create_superuser("root", "root@example.com", "x")
    client = Client()
    client.force_login(user)
    return client


def slow_queries(client: Client, url: str) -> list[str]:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200, url
    return [q["sql"] for q in ctx.captured_queries if SLOW.search(q["sql"])]


@pytest.mark.parametrize(("model", "filters", "term"), PAGES, ids=[m._meta.model_name for m, _, _ in PAGES])
def test_a_changelist_page_with_each_filter_and_a_search_runs_no_distinct_date_trunc_upper_or_like(
    admin_client_, bot, model, filters, term
) -> None:
    update = stored_update(bot)
    message_row(bot, key="k-scale", trace_id="trace-abc", source_update=update)
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    for query in ["", *[f"?{f}" for f in filters], f"?q={term}", f"?{filters[0]}&q={term}"]:
        assert slow_queries(admin_client_, url + query) == [], query


def test_the_trace_id_search_finds_the_message_exactly_and_a_number_finds_its_chat(admin_client_, bot) -> None:
    message_row(bot, key="k-one", trace_id="trace-abc", chat_id=777)
    message_row(bot, key="k-two", trace_id="trace-abcdef", chat_id=778)
    url = reverse("admin:outbox_outboundmessage_changelist")
    page = admin_client_.get(url, {"q": "trace-abc"}).context["cl"]
    assert [m.idempotency_key for m in page.result_list] == ["k-one"]
    page = admin_client_.get(url, {"q": "778"}).context["cl"]
    assert [m.idempotency_key for m in page.result_list] == ["k-two"]
    page = admin_client_.get(url, {"q": "k-two"}).context["cl"]
    assert [m.idempotency_key for m in page.result_list] == ["k-two"]


def test_the_method_filter_offers_the_bot_api_methods_without_reading_the_table(admin_client_, bot) -> None:
    page = admin_client_.get(reverse("admin:outbox_outboundmessage_changelist"), {"method": "sendPhoto"})
    assert page.status_code == 200
    assert "sendDocument" in page.content.decode()


def test_an_update_is_found_by_its_update_id_and_a_word_is_not_taken_for_one(admin_client_, bot) -> None:
    update = stored_update(bot, update_id=987654)
    url = reverse("admin:bots_inboundupdate_changelist")
    assert [u.pk for u in admin_client_.get(url, {"q": "987654"}).context["cl"].result_list] == [update.pk]
    assert list(admin_client_.get(url, {"q": "hello"}).context["cl"].result_list) == []
