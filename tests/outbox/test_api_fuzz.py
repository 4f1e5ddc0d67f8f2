"""Fuzzing the REST API with a real token: every /api/v1/ URL and method, odd ids in the path,
bodies of the wrong types and shapes, odd Idempotency-Key headers. Whatever comes, the answer
is never a 5xx, and a request that is refused writes no message row and leaves no key in
progress (hypothesis generates the requests; a failure prints the example to replay)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bots.models import Bot
from outbox.models import IdempotencyRecord, OutboundMessage
from tests.outbox.helpers import api_client

pytestmark = pytest.mark.django_db(transaction=True)

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NOT_FOUND_OR_REFUSED = {301, 400, 403, 404, 405, 406, 409, 413, 415, 422}
CREATED_OR_REPLAYED = {200, 201}


def nested(depth: int, leaf: str = '"x"') -> str:
    """A JSON text nested `depth` levels, arrays and objects in turn."""
    opening = "".join("[" if n % 2 else '{"k":' for n in range(depth))
    closing = "".join("]" if n % 2 else "}" for n in reversed(range(depth)))
    return opening + leaf + closing


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["NaN", "Infinity", "-1", "1e999", "\x00", "a\x00b", "²", "--5", " 42 ", "0x10"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
chat_ids = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**63 - 1, -(2**63), 2**63, 1.5, 1e300, True, "12", "NaN", "abc", "", [1], {"id": 1}]),
)
payloads = st.one_of(
    st.fixed_dictionaries({"text": st.one_of(st.text(max_size=30), scalars)}, optional={"parse_mode": scalars}),
    json_values,
    st.lists(json_values, max_size=3),
    st.sampled_from(
        [
            {"text": "a\x00b"},
            {"text\x00": "hi"},
            {"text": "\ud83d"},
            {"text": "ok", "reply_markup": {"inline_keyboard": [[{"text": "\udc00", "callback_data": "x"}]]}},
            {"text": "x" * 5000},
            {"text": "ok", "chat_id": 5},
            {"text": "ok", "n": 10**300},
        ]
    ),
)
datetimes = st.one_of(
    st.none(),
    st.text(max_size=25),
    st.integers(),
    st.sampled_from(
        [
            "2030-01-01T00:00:00Z",
            "2030-01-01T00:00:00",
            "2030-02-30T00:00:00Z",
            "9999-12-31T23:59:59-12:00",
            "0001-01-01T00:00:00+14:00",
            "2030-01-01T25:00:00Z",
            "1970-01-01T00:00:00Z",
            "2030-01-01T00:00:00.123456789+05:30",
        ]
    ),
)
send_options = {
    "method": st.one_of(st.sampled_from(["sendMessage", "sendPhoto", "sendChatAction", "launchRocket", ""]), scalars),
    "payload": payloads,
    "send_at": datetimes,
    "expires_at": datetimes,
    "on_ambiguous": st.one_of(st.sampled_from(["hold", "resend", "maybe", "HOLD", ""]), scalars),
}
bot_names = st.one_of(st.sampled_from(["shop", "other", "nobody", "shop\x00", "", "s" * 65]), scalars)
message_bodies = st.fixed_dictionaries(
    {"bot": bot_names, "chat_id": chat_ids},
    optional={**send_options, "ordered": st.one_of(st.booleans(), scalars)},
)
broadcast_bodies = st.fixed_dictionaries(
    {"bot": bot_names, "chat_ids": st.one_of(st.lists(chat_ids, max_size=4), chat_ids)},
    optional=send_options,
)
odd_keys = st.one_of(
    st.none(),
    st.sampled_from(["", " ", "k" * 255, "k" * 256, "k" * 10_000, "a\x00b", "a\x1fb", "\x7f", "é-ключ-🐦", "\ud83d"]),
    st.text(max_size=300).filter(lambda k: "\n" not in k and "\r" not in k),
)
raw_bodies = st.one_of(
    st.binary(max_size=100),
    st.integers(min_value=1, max_value=5000).map(nested),
    st.sampled_from(
        [
            '{"bot": "shop", "chat_id": NaN, "payload": {"text": "x"}}',
            '{"bot": "shop", "chat_id": 1, "payload": {"text": Infinity}}',
            '{"bot": "shop", "chat_id": 1e999, "payload": {"text": "x"}}',
            '{"bot": "shop", "chat_id": 1, "payload": {"text": "\\u0000"}}',
            '{"bot": "shop", "chat_id": 1, "payload": {"text": "\\ud800"}}',
            '{"bot": "shop", "chat_ids": [1], "payload": {"text": "\\udfff"}}',
            '{"bot": "shop", "chat_id": ' + "9" * 5000 + ', "payload": {"text": "x"}}',
            '{"bot": "shop", "chat_id": 1, "payload": ' + nested(500) + "}",
            '{"bot": "shop", "chat_ids": [1], "payload": ' + nested(900) + "}",
            "[" * 100_000,
        ]
    ).map(str.encode),
)
content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"])


def shop_and_other() -> tuple[Bot, Bot]:
    def bot(name: str, n: int) -> Bot:
        token = f"{990000 + n}:AAfuzz-token-{n:04d}-abcdefghijklmnopqrstuvwxyz"
        return Bot.objects.get_or_create(name=name, defaults={"token": token, "api_base_url": "http://127.0.0.1:9"})[0]

    return bot("shop", 1), bot("other", 2)


def client() -> Any:
    """A client granted "shop" only, without payload access; "other" is someone else's bot."""
    shop, _ = shop_and_other()
    return api_client("fuzzer", shop, payload_access=False)


def written() -> tuple[int, int]:
    return OutboundMessage.objects.count(), IdempotencyRecord.objects.filter(in_progress=True).count()


def check(response: Any, before: tuple[int, int], *, creates: bool) -> None:
    """No 5xx; a refused request wrote no message and left no key in progress."""
    assert response.status_code < 500, response.content[:500]
    messages, in_progress = written()
    assert in_progress == before[1], "a request left its Idempotency-Key in progress"
    if not creates or response.status_code not in CREATED_OR_REPLAYED:
        assert response.status_code in NOT_FOUND_OR_REFUSED | CREATED_OR_REPLAYED, response.status_code
        assert messages == before[0], f"{response.status_code} wrote {messages - before[0]} message(s)"
        return
    body = response.json()
    new = len(body["parts"]) if "parts" in body else body["created"]
    assert messages - before[0] == (new if response.status_code == 201 else 0)


def post(path: str, body: Any, key: str | None, content_type: str = "application/json") -> Any:
    """`body` as it is (bytes) or as JSON text: ASCII, as a client's JSON may be, so that half a
    surrogate pair travels as its escape."""
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    data = body if isinstance(body, bytes) else json.dumps(body)
    return client().post(path, data, content_type=content_type, **headers)


@FUZZ
@given(body=message_bodies, key=odd_keys)
@example(body={"bot": "shop", "chat_id": 1, "payload": {"text": "a\x00b"}}, key="nul")
@example(body={"bot": "shop\x00", "chat_id": 1, "payload": {"text": "x"}}, key="nul-bot")
def test_message_bodies_of_any_shape_never_get_a_5xx_nor_half_write(body: dict, key: str | None) -> None:
    before = written()
    response = post("/api/v1/messages/", body, key)
    check(response, before, creates=True)


@FUZZ
@given(body=broadcast_bodies, key=odd_keys)
@example(body={"bot": "shop", "chat_ids": [1, 2], "payload": {"text": "\ud83d"}}, key="surrogate")
def test_broadcast_bodies_of_any_shape_never_get_a_5xx_nor_half_write(body: dict, key: str | None) -> None:
    before = written()
    response = post("/api/v1/broadcasts/", body, key)
    check(response, before, creates=True)


@FUZZ
@given(
    raw=raw_bodies,
    content_type=content_types,
    path=st.sampled_from(["/api/v1/messages/", "/api/v1/broadcasts/"]),
    key=odd_keys,
)
@example(raw=nested(5000).encode(), content_type="application/json", path="/api/v1/messages/", key="deep")
@example(
    raw=('{"bot": "shop", "chat_id": 1, "payload": ' + nested(900) + "}").encode(),
    content_type="application/json",
    path="/api/v1/messages/",
    key="deep-payload",
)
def test_raw_bodies_never_get_a_5xx_nor_half_write(raw: bytes, content_type: str, path: str, key: str | None) -> None:
    before = written()
    response = post(path, raw, key, content_type=content_type)
    check(response, before, creates=True)


def a_message_id() -> int:
    shop, other = shop_and_other()
    for bot, key in ((shop, "mine"), (other, "theirs")):
        OutboundMessage.objects.get_or_create(
            bot=bot,
            idempotency_key=key,
            defaults={"chat_id": 5, "payload": {"text": "hi"}, "next_attempt_at": "2030-01-01T00:00:00Z"},
        )
    return OutboundMessage.objects.get(bot=shop, idempotency_key="mine").pk


ids_in_path = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["²", "--5", "-5", "0", "00", "1e3", "\uff19", "9223372036854775807", "9223372036854775808"]),
    st.sampled_from(["18446744073709551616", "9" * 400, " 1", "1.5", "%00", "mine", "theirs"]),
    st.text(max_size=8),
)
url_shapes = st.sampled_from(
    [
        "/api/v1/messages/",
        "/api/v1/broadcasts/",
        "/api/v1/messages/{}/",
        "/api/v1/messages/{}/cancel/",
        "/api/v1/messages/{}",
        "/api/v1/broadcasts/{}/",
        "/api/v1/{}/",
    ]
)
http_methods = st.sampled_from(["get", "post", "put", "patch", "delete", "head", "options"])


@FUZZ
@given(shape=url_shapes, id_=ids_in_path, method=http_methods, body=json_values, key=odd_keys)
@example(shape="/api/v1/messages/{}/", id_="9" * 400, method="get", body=None, key=None)
@example(shape="/api/v1/messages/{}/cancel/", id_="9223372036854775808", method="post", body={}, key=None)
@example(shape="/api/v1/messages/{}/cancel/", id_="mine", method="post", body={"reason": "a\x00b"}, key=None)
def test_every_url_and_method_never_gets_a_5xx_nor_half_writes(
    shape: str, id_: str, method: str, body: Any, key: str | None
) -> None:
    mine = a_message_id()
    # "mine" and "theirs" stand for real ids: a message of the client's bot and another's.
    id_ = {"mine": str(mine), "theirs": str(mine + 1)}.get(id_, id_)
    path = shape.format(quote(id_, safe=""))
    states = list(OutboundMessage.objects.order_by("pk").values_list("state", flat=True))
    before = written()
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}

    if method in ("get", "head", "options", "delete"):
        response = getattr(client(), method)(path, **headers)
    else:
        response = getattr(client(), method)(path, json.dumps(body), content_type="application/json", **headers)

    check(response, before, creates=path in ("/api/v1/messages/", "/api/v1/broadcasts/") and method == "post")
    if "cancel" not in path or response.status_code != 200:
        assert list(OutboundMessage.objects.order_by("pk")[: len(states)].values_list("state", flat=True)) == states
