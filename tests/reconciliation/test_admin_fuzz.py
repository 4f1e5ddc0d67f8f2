"""Whatever a superuser types into the admin - a search, a list filter's value, an ordering, an
object id in a URL, a custom view's parameters, a form's fields - the answer is never a 5xx:
bad input is a 400 or 404, an empty result, or the form again with its errors (hypothesis
generates the input, for every admin URL the project routes)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest
from django.contrib import admin
from django.contrib.admin.views.main import ORDER_VAR, PAGE_VAR, SEARCH_VAR
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client, RequestFactory
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bots.models import AnalyticsEvent, ChatState
from outbox.models import ApiClient, Circuit, DeadLetter, Effect
from reconciliation.models import AuditEntry, BulkRetry, PayloadVersion, ReconciliationCase
from tests.reconciliation.factories import message_row
from tests.reconciliation.triage_helpers import failed_row, failed_run, logged_in, persona

pytestmark = pytest.mark.django_db

# A model's pages run Django's code with the project's options; the custom views are the
# project's own code, so they get more examples.
FUZZ = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FUZZ_CUSTOM = settings(FUZZ, max_examples=50)

# What broke pages (issue #41), and its kin: digits int() refuses, signs, numbers past 64 bits,
# a NUL (PostgreSQL refuses it in text), scopes and JSON of every shape.
ODD = [
    "²",
    "--5",
    "-",
    "+5",
    " 7 ",
    "0",
    "-0",
    "٣",
    "9" * 25,
    "-9223372036854775809",
    "9223372036854775808",
    "1e3",
    "\x00",
    "a\x00b",
    "NaN",
    "%",
    "'",
    "<b>",
    "",
    "bot:",
    "bot:²",
    "bot:--5",
    "bot:999999",
    "consumer:",
    "consumer:\x00",
    "{}",
    "[]",
    '{"text": 1}',
    "[" * 2000,
    "2024-13-40 25:61",
    "9999-12-31 23:59",
    "0001-01-01 00:00",
]
typed = st.one_of(st.sampled_from(ODD), st.text(max_size=30), st.integers().map(str))


def routes() -> Iterator[tuple[str, URLPattern]]:
    """Every admin route of the project, as (route text, pattern)."""

    def walk(patterns: list[Any], prefix: str) -> Iterator[tuple[str, URLPattern]]:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern))
            else:
                yield prefix + str(pattern.pattern), pattern

    for route, pattern in walk(get_resolver().url_patterns, ""):
        # Not logout: it would end the session every other example uses, and takes no input.
        if route.startswith("admin/") and pattern.name != "logout":
            yield route, pattern


MODEL_ADMINS = {f"{m._meta.app_label}/{m._meta.model_name}": ma for m, ma in admin.site._registry.items()}
STANDARD = ("changelist", "add", "history", "delete", "change")


def is_standard(route: str, pattern: URLPattern) -> bool:
    """A model's changelist, add, change, delete or history page (or the old change URL)."""
    model = route.removeprefix("admin/").split("/")
    if "/".join(model[:2]) not in MODEL_ADMINS:
        return False
    return pattern.name is None or pattern.name.endswith(tuple(f"_{name}" for name in STANDARD))


# Every other admin route: the project's own views (retry, cancel, decide, the dashboard,
# pause/resume) and the site's (index, app lists, autocomplete, view on site, password change).
CUSTOM_ROUTES = sorted(route for route, pattern in routes() if not is_standard(route, pattern))
# The parameters the custom views read, beside anything hypothesis makes up.
CUSTOM_PARAMETERS = [
    "bot",
    "scope",
    "reason",
    "corrected_payload",
    "telegram_message_id",
    "consumer",
    "reason_class",
    "since",
    "app_label",
    "model_name",
    "field_name",
    "term",
    "page",
    "next",
    "old_password",
    "new_password1",
    "new_password2",
]


@pytest.fixture
def root(bot_factory) -> Client:
    """A superuser's session, and a row of each of the project's models (the installed apps'
    have theirs from the migrations, or none)."""
    bot = bot_factory()
    letter = failed_row(bot)
    update = failed_run(bot).consumer_run.update
    message = message_row(bot, key="unknown", state="unknown")
    ReconciliationCase.objects.create(message=message, idempotency_key="unknown")
    PayloadVersion.objects.create(message=message, number=1, payload={"text": "x"})
    BulkRetry.objects.create(reason="x", item_ids=[letter.pk], total=1)
    Circuit.objects.create(scope=f"bot:{bot.pk}")
    Effect.objects.create(key="eff:1", state="done")
    AnalyticsEvent.objects.create(bot=bot, update=update, received_at=timezone.now())
    ChatState.objects.create(bot=bot, chat_id=1, last_answered_at=timezone.now() - timedelta(days=1))
    user = persona("root", superuser=True)
    AuditEntry.objects.create(actor=user, action="x", target="y")
    ApiClient.objects.create(user=persona("api"))
    return logged_in(user)


def existing_ids(model_admin: admin.ModelAdmin) -> list[str]:
    return [str(pk) for pk in model_admin.model._default_manager.values_list("pk", flat=True)[:5]]


def existing_row_ids() -> list[int]:
    """The integer ids of the rows the fixture made, of every model."""
    ids = (pk for model_admin in MODEL_ADMINS.values() for pk in existing_ids(model_admin))
    return sorted({int(pk) for pk in ids if pk.isdecimal()})


def answer(client: Client, method: str, path: str, params: dict[str, Any]) -> int:
    """The status of one request, made in a savepoint that is rolled back: every example
    starts from the same rows, and a database error in the view reaches the test, not the
    next example."""
    with transaction.atomic():
        status = getattr(client, method)(path, params).status_code
        transaction.set_rollback(True)
    return status


def changelist_parameters(model_admin: admin.ModelAdmin, user: User) -> list[str]:
    """The query parameters a changelist reads: search, ordering, page, every list filter's."""
    request = RequestFactory().get("/")
    request.user = user
    changelist = model_admin.get_changelist_instance(request)
    names = [SEARCH_VAR, ORDER_VAR, PAGE_VAR, "all", "_facets", "e", "_to_field", "_popup"]
    names += [name for spec in changelist.filter_specs for name in spec.expected_parameters()]
    if model_admin.date_hierarchy:
        names += [f"{model_admin.date_hierarchy}__{part}" for part in ("year", "month", "day")]
    return names


def form_fields(model_admin: admin.ModelAdmin, user: User, object_id: str | None) -> list[str]:
    """The fields of the add form (no id) or of the object's change form."""
    request = RequestFactory().get("/")
    request.user = user
    obj = model_admin.get_object(request, object_id) if object_id is not None else None
    return list(model_admin.get_form(request, obj).base_fields)


@FUZZ
@pytest.mark.parametrize("model", sorted(MODEL_ADMINS))
# A date filter's value of year 1 reaches Django as a naive datetime; it warns, and answers.
@pytest.mark.filterwarnings("ignore:DateTimeField .* received a naive datetime")
@given(data=st.data())
def test_a_changelist_answers_any_search_filter_ordering_and_action(root, model: str, data: st.DataObject) -> None:
    model_admin = MODEL_ADMINS[model]
    user = User.objects.get(username="root")
    names = changelist_parameters(model_admin, user)
    params = data.draw(st.dictionaries(st.sampled_from(names) | st.text(max_size=12), typed, max_size=5))
    method = data.draw(st.sampled_from(["get", "get", "post"]))
    if method == "post":
        request = RequestFactory().get("/")
        request.user = user
        actions = list(model_admin.get_actions(request))
        params["action"] = data.draw(st.sampled_from([*actions, "no_such_action"]) | typed)
        params["_selected_action"] = data.draw(st.lists(st.sampled_from(existing_ids(model_admin) or ["1"]) | typed))
        params["index"] = data.draw(st.sampled_from(["0", "1"]) | typed)

    status = answer(root, method, f"/admin/{model}/", params)

    assert status < 500, (method, params)


@FUZZ
@pytest.mark.parametrize("model", sorted(MODEL_ADMINS))
@given(data=st.data())
def test_an_object_page_answers_any_id_and_any_form(root, model: str, data: st.DataObject) -> None:
    model_admin = MODEL_ADMINS[model]
    user = User.objects.get(username="root")
    object_id = data.draw(st.sampled_from(existing_ids(model_admin) or ["1"]) | typed)
    page = data.draw(st.sampled_from(["change/", "delete/", "history/", "", "add/"]))
    method = data.draw(st.sampled_from(["get", "post"]))
    path = f"/admin/{model}/add/" if page == "add/" else f"/admin/{model}/{quote(object_id, safe='')}/{page}"
    params: dict[str, Any] = {}
    if method == "post":
        fields = form_fields(model_admin, user, None if page == "add/" else object_id)
        params = data.draw(st.dictionaries(st.sampled_from([*fields, "post", "_save"]) | st.text(max_size=12), typed))

    status = answer(root, method, path, params)

    assert status < 500, (method, path, params)


def custom_path(route: str, data: st.DataObject) -> str:
    """`route` with each of its arguments drawn: an int converter's are digits (a row's id,
    or any), as its pattern lets through; a regular expression's groups anything."""
    words = st.sampled_from(["pause", "resume", "cancel", "resend", "mark_delivered", "outbox", "bots", "1"])
    row_ids = existing_row_ids()

    def argument(match: re.Match) -> str:
        if match["converter"] == "int":
            return str(data.draw(st.sampled_from(row_ids) | st.integers(min_value=0)))
        return quote(data.draw(words | typed), safe="")

    path = re.sub(r"<(?P<converter>\w+):\w+>|\(\?P<\w+>[^)]*\)", argument, route)
    return "/" + path.replace("^", "").replace("$", "")


@FUZZ_CUSTOM
@pytest.mark.parametrize("route", CUSTOM_ROUTES)
@given(data=st.data())
def test_a_custom_view_answers_any_path_and_any_parameters(root, route: str, data: st.DataObject) -> None:
    path = custom_path(route, data)
    method = data.draw(st.sampled_from(["get", "post"]))
    params = data.draw(st.dictionaries(st.sampled_from(CUSTOM_PARAMETERS) | st.text(max_size=12), typed, max_size=6))
    query = data.draw(st.dictionaries(st.sampled_from(["bot", "scope"]), typed, max_size=2))
    if method == "post" and query:
        path += "?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in query.items())

    status = answer(root, method, path, params if method == "post" else {**params, **query})

    assert status < 500, (method, path, params)


# The audit's cases (issue #41) and what hypothesis found next to them, each with the answer
# a user gets: an empty result, the admin's "does not exist" redirect, a 400 or a 404.
FOUND = [
    ("get", "/admin/outbox/outboundmessage/", {"q": "²"}, 200),
    ("get", "/admin/outbox/deadletter/", {"q": "--5"}, 200),
    ("get", "/admin/bots/inboundupdate/", {"q": "²"}, 200),
    ("get", "/admin/outbox/outboundmessage/²/change/", {}, 302),
    ("get", "/admin/outbox/outboundmessage/--5/change/", {}, 302),
    ("get", "/admin/bots/bot/²/change/", {}, 302),
    ("get", "/admin/ops/dashboard/", {"bot": "999999"}, 404),
    ("get", "/admin/ops/dashboard/data.json", {"bot": "999999"}, 404),
    ("get", "/admin/ops/dashboard/fragment/", {"bot": "²"}, 400),
    ("get", "/admin/ops/circuit/pause/", {"scope": "bot:²"}, 404),
    ("post", "/admin/ops/circuit/pause/?scope=bot:--5", {"reason": "typo"}, 404),
    ("post", "/admin/ops/circuit/pause/?scope=consumer:%00", {"reason": "NUL"}, 400),
    ("get", "/admin/outbox/effect/", {"state__exact": "\x00"}, 400),
    ("post", "/admin/auth/group/", {"action": "delete_selected", "_selected_action": "²", "index": "0"}, 400),
    ("get", "/admin/reconciliation/auditentry/", {"created_at__year": "9999"}, 302),
    ("post", "/admin/django_celery_beat/crontabschedule/add/", {"minute": "--5"}, 200),
    ("post", "/admin/django_celery_beat/periodictask/add/", {"args": "[" * 2000}, 200),
]


@pytest.mark.parametrize(("method", "path", "params", "status"), FOUND)
def test_input_that_was_a_500_gets_its_answer(root, method: str, path: str, params: dict, status: int) -> None:
    assert answer(root, method, path, params) == status


@pytest.mark.parametrize(
    "corrected",
    [
        pytest.param("[" * 2000, id="past-json's-recursion"),
        pytest.param('{"a": ' * 65 + "1" + "}" * 65, id="65-levels"),
    ],
)
def test_an_edit_and_retry_nested_past_any_payload_s_depth_is_the_form_again(root, corrected: str) -> None:
    letter = DeadLetter.objects.exclude(message=None).get()
    url = reverse("admin:outbox_deadletter_retry", args=[letter.pk])

    page = root.post(url, {"reason": "fix", "corrected_payload": corrected})

    assert page.status_code == 200
    assert "nested deeper than 64 levels" in page.content.decode()
    assert not PayloadVersion.objects.filter(message=letter.message, author__isnull=False).exists()


def test_view_on_site_of_a_model_without_a_table_is_a_404(root) -> None:
    """reconciliation.TriagePermissions holds the operators' permissions and has no table."""
    from django.contrib.contenttypes.models import ContentType

    from reconciliation.models import TriagePermissions

    content_type = ContentType.objects.get_for_model(TriagePermissions)

    assert answer(root, "get", f"/admin/r/{content_type.pk}/1/", {}) == 404
