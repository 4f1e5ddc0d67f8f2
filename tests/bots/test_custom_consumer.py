"""The README's consumer example, written exactly as the README shows it, runs with its own
routing, retries and dead letter - next to the built-in consumers, untouched by them.

The consumer is registered inside a fixture (as importing a developer's consumers.py
would) and unregistered afterwards, so other tests see the built-in registry only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

from bots import registry
from bots.models import RunState
from outbox.models import DeadLetter, OutboundMessage
from tests.bots.fakes import FakeServer, deliver, execute, message_update, receive, run_of

pytestmark = pytest.mark.django_db


class FakeShop(FakeServer):
    """GET /orders/<id>: answers `statuses` first (e.g. 503s), then the order."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[int] = []
        self.requests: list[str] = []

    def handle(self, method: str, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        with self.lock:
            self.requests.append(path)
            if self.statuses:
                return self.statuses.pop(0), {"error": "try later"}
        if path == "/orders/1042":
            return 200, {"id": 1042, "status": "shipped"}
        return 404, {"error": "no such order"}


@pytest.fixture
def shop() -> Iterator[FakeShop]:
    server = FakeShop().start()
    with override_settings(SHOP_API_URL=server.url):
        yield server
    server.stop()


@pytest.fixture
def order_status_consumer() -> Iterator[None]:
    # --- from the README, verbatim ------------------------------------------------------------
    from datetime import timedelta

    import httpx
    from django.conf import settings

    from bots.registry import ConsumerContext, PermanentError, TransientError, consumer

    @consumer(
        "order_status",  # a stable name: stored on runs and in idempotency keys
        update_types=["message"],  # also what set_webhook asks Telegram for
        chat_types=["private"],
        max_attempts=4,  # then a dead letter that an operator can retry
        backoff=(1, 10, 60),  # seconds before the 2nd, 3rd, 4th attempt (with jitter)
        max_age=timedelta(minutes=30),  # an older run is cancelled with a reason, not run late
    )
    def order_status(ctx: ConsumerContext) -> str:
        if not ctx.text.startswith("/order"):
            return "not-an-order"  # stored on the run as its outcome
        order_id = ctx.text.removeprefix("/order").strip()
        if not order_id.isdigit():
            ctx.reply("Send /order and your order number, e.g. /order 1042")
            return "usage"
        try:
            response = httpx.get(f"{settings.SHOP_API_URL}/orders/{order_id}", timeout=5)
        except httpx.TransportError as exc:
            raise TransientError(f"shop API unreachable: {exc}") from exc  # retried with backoff
        if response.status_code >= 500:
            raise TransientError(f"shop API answered {response.status_code}")
        if response.status_code == 404:
            ctx.reply(f"I cannot find order {order_id}.")
            return "unknown-order"
        if response.status_code != 200:
            raise PermanentError(f"shop API refused: {response.status_code}")  # dead letter at once
        # Through the outbox, with the key upd:<update_id>:order_status:0 - a retry of this
        # run can never send it twice.
        ctx.reply(f"Order {order_id}: {response.json()['status']}")
        return "answered"

    # --- end of the README example -------------------------------------------------------------
    yield
    registry.unregister("order_status")


def test_the_readme_consumer_is_routed_by_its_update_and_chat_types(order_status_consumer: None, bot) -> None:
    private = receive(bot, message_update(chat_id=1, text="/order 1042", message_id=1))
    group = receive(bot, message_update(chat_id=-100, text="/order 1042", message_id=1, chat_type="group"))

    assert private.runs.filter(consumer="order_status").exists()
    assert not group.runs.filter(consumer="order_status").exists()
    assert run_of(private, "order_status").max_attempts == 4


@pytest.mark.django_db(transaction=True)  # a run's reply leaves after its commit
def test_the_readme_consumer_retries_on_its_own_and_answers_once(
    order_status_consumer: None, shop: FakeShop, bot, sandbox
) -> None:
    shop.statuses = [503]
    update = receive(bot, message_update(chat_id=1, text="/order 1042", message_id=1))

    # The built-in consumer is not held up: the router answered at once.
    assert run_of(update, "auto_reply").state == RunState.DONE
    assert sandbox.sent_texts(token=bot.token, chat_id=1) == ["Echo: /order 1042"]
    assert execute(update, "order_status") == "retry"
    run = run_of(update, "order_status")
    assert (run.state, run.attempts, run.last_error_class) == (RunState.RETRY, 1, "transient")
    # Its own backoff: about 1 s (with jitter) before the second attempt.
    wait = (run.next_attempt_at - run.updated_at).total_seconds()
    assert 0.7 <= wait <= 1.3
    assert execute(update, "order_status") == "not-due"

    assert execute(update, "order_status", due_now=True) == "done"
    run.refresh_from_db()
    assert (run.state, run.attempts, run.outcome) == (RunState.DONE, 2, "answered")
    assert shop.requests == ["/orders/1042", "/orders/1042"]
    deliver(bot)  # the answer, if the chat's one message a second kept it from going at once
    assert sandbox.sent_texts(token=bot.token, chat_id=1) == ["Echo: /order 1042", "Order 1042: shipped"]
    reply = OutboundMessage.objects.get(consumer="order_status")
    assert reply.idempotency_key == f"upd:{update.update_id}:order_status:0"
    assert reply.trace_id == update.trace_id


def test_the_readme_consumer_is_dead_lettered_after_its_own_attempts(
    order_status_consumer: None, shop: FakeShop, bot
) -> None:
    shop.statuses = [503] * 10
    update = receive(bot, message_update(chat_id=1, text="/order 1042", message_id=1))

    results = [execute(update, "order_status", due_now=True) for _ in range(5)]

    assert results == ["retry", "retry", "retry", "dead-lettered", "not-waiting"]
    letter = DeadLetter.objects.get(consumer="order_status")
    assert letter.reason_class == "exhausted"
    assert letter.trace_id == update.trace_id
    assert "503" in letter.last_error
    assert run_of(update, "auto_reply").state == RunState.DONE  # untouched by the failure
