"""Whatever arrives at the webhook or the API - any body, any headers, any method - the answer
is one of the contract's codes, never a 5xx, and a rejected request stores nothing
(hypothesis generates the requests)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from django.db.models import TextField
from django.db.models.functions import Cast
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from bots.models import InboundUpdate
from outbox.models import IdempotencyRecord, OutboundMessage
from tests.outbox.helpers import api_client

pytestmark = pytest.mark.django_db(transaction=True)


def exact(text: str | bytes) -> object:
    """A JSON document with every number an exact decimal."""
    return json.loads(text, parse_float=Decimal, parse_int=Decimal)


SECRET = "props-secret"
WEBHOOK_CODES = {200, 400, 403, 404, 405, 413}
API_CODES = {200, 201, 400, 401, 403, 404, 405, 409, 415, 422}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
update_like = st.fixed_dictionaries(
    {
        "update_id": st.one_of(
            st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False, allow_infinity=False)
        )
    },
    optional={"message": json_values, "callback_query": json_values},
)
bodies = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    json_values.map(lambda v: json.dumps(v).encode()),
    update_like.map(lambda v: json.dumps(v).encode()),
    st.integers(min_value=1, max_value=400).map(lambda depth: ("[" * depth + "]" * depth).encode()),
)
secrets_given = st.one_of(st.none(), st.just(SECRET), st.text(max_size=30))
methods = st.sampled_from(["post", "post", "post", "get", "put", "patch", "delete"])
content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(
    body=bodies,
    secret=secrets_given,
    method=methods,
    content_type=content_types,
    name=st.sampled_from(["shop", "nobody"]),
)
# Found by hypothesis: a float with an integral value, which jsonb keeps as that integer.
@example(
    body=b'{"update_id": 42, "callback_query": {"a": 6.111841964020245e+16, "b": 0.1}}',
    secret=SECRET,
    method="post",
    content_type="text/plain",
    name="shop",
)
def test_the_webhook_answers_a_contract_code_to_anything_and_stores_only_what_it_accepts(
    client, bot_factory, body: bytes, secret: str | None, method: str, content_type: str, name: str
) -> None:
    from bots.models import Bot

    Bot.objects.filter(name="shop").exists() or bot_factory(name="shop", webhook_secret=SECRET)
    before = InboundUpdate.objects.count()
    headers = {} if secret is None else {"X-Telegram-Bot-Api-Secret-Token": secret}

    url = f"/webhooks/telegram/{name}/"
    if method == "get":
        response = client.get(url, headers=headers)
    else:
        response = getattr(client, method)(url, data=body, content_type=content_type, headers=headers)

    assert response.status_code in WEBHOOK_CODES
    stored = InboundUpdate.objects.count() - before
    if response.status_code != 200:
        assert stored == 0
    else:
        assert stored <= 1  # a redelivered update_id is answered 200 and stored once
    if stored:
        # Stored as it came (the body's text, PostgreSQL parsing it): the same update, number
        # for number. Compared as exact decimals: jsonb keeps 6.111841964020245e+16 as the
        # integer it is (61118419640202450), which Python reads back as an int, while
        # json.loads rounds the text to the float 61118419640202448.0.
        stored_text = InboundUpdate.objects.filter(pk=InboundUpdate.objects.latest("id").pk).values_list(
            Cast("payload", TextField()), flat=True
        )[0]
        assert exact(stored_text) == exact(body)


api_bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "bot": st.sampled_from(["shop", "other", "nobody", 5]),
            "chat_id": st.one_of(st.integers(), st.text(max_size=4)),
        },
        optional={
            "payload": json_values,
            "method": st.sampled_from(["sendMessage", "sendPhoto", "launchRocket", 3]),
            "send_at": st.one_of(st.text(max_size=10), st.just("2030-01-01T00:00:00Z")),
            "on_ambiguous": st.sampled_from(["hold", "resend", "maybe"]),
            "chat_ids": st.lists(st.integers(), max_size=3),
        },
    ),
)
keys = st.one_of(st.none(), st.text(min_size=0, max_size=300).filter(lambda k: "\n" not in k and "\r" not in k))


@PROPERTY
@given(
    body=api_bodies,
    key=keys,
    path=st.sampled_from(["/api/v1/messages/", "/api/v1/broadcasts/"]),
    authed=st.booleans(),
)
def test_the_api_answers_a_contract_code_to_anything_and_stores_nothing_it_refuses(
    bot_factory, body, key: str | None, path: str, authed: bool
) -> None:
    from bots.models import Bot

    shop = Bot.objects.filter(name="shop").first() or bot_factory(name="shop")
    Bot.objects.filter(name="other").exists() or bot_factory(name="other")
    client = api_client("props", shop) if authed else APIClient()
    before = (OutboundMessage.objects.count(), IdempotencyRecord.objects.filter(in_progress=True).count())
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}

    response = client.post(path, body, format="json", **headers)

    assert response.status_code in API_CODES
    if response.status_code not in (200, 201):
        assert OutboundMessage.objects.count() == before[0]
    # A refused request never leaves its key "in progress" (that would answer 409 for ever).
    assert IdempotencyRecord.objects.filter(in_progress=True).count() == before[1]
