"""Fan-out to independent consumers, in-process against the real PostgreSQL, the sandbox over
HTTP and local fake CRM / model servers, with production's inline work: routing runs the echo
auto-reply and analytics at once, and a run sends its replies right after their commit (a
test that sees them sent is transactional)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from bots import registry
from bots.inbox import inbox_update_store
from bots.models import AnalyticsEvent, ConsumerRun, InboundUpdate, RunState
from bots.runs import consumer_run_execute
from outbox.models import DeadLetter, OutboundMessage, State
from tests.bots.fakes import (
    FakeCRM,
    FakeOpenAI,
    deliver,
    execute,
    message_update,
    receive,
    route,
    route_all,
    run_of,
    store,
)

CRM_LOOKUP = "tests.bots.fakes.crm_lookup"


@pytest.fixture
def crm() -> Iterator[FakeCRM]:
    server = FakeCRM().start()
    yield server
    server.stop()


@pytest.fixture
def model() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI(reply="Yes, it is still available.").start()
    yield server
    server.stop()


# --- routing -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_each_update_gets_one_run_per_matching_consumer_recorded_at_routing(bot, crm: FakeCRM) -> None:
    with override_settings(DOVECOTE_CRM_WEBHOOK_URL=crm.url):
        message = receive(bot, message_update(chat_id=7, text="hi", message_id=1))
        button = receive(bot, {"update_id": 99, "callback_query": {"id": "1", "from": {"id": 7}, "data": "x"}})

    assert set(message.runs.values_list("consumer", flat=True)) == {"auto_reply", "crm_webhook", "analytics"}
    # Only analytics wants every update type.
    assert list(button.runs.values_list("consumer", flat=True)) == ["analytics"]
    assert all(r.trace_id == message.trace_id for r in message.runs.all())


@pytest.mark.django_db
def test_crm_webhook_is_not_routed_when_no_crm_url_is_set(bot) -> None:
    with override_settings(DOVECOTE_CRM_WEBHOOK_URL=""):
        update = receive(bot, message_update(chat_id=7, text="hi", message_id=1))
    assert not update.runs.filter(consumer="crm_webhook").exists()


# --- fan-out independence --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@override_settings(DOVECOTE_CRM_LOOKUP=CRM_LOOKUP)
def test_a_crm_that_is_down_does_not_stop_the_auto_reply_and_is_retried_without_a_duplicate_lead(
    bot, sandbox, crm: FakeCRM
) -> None:
    crm.failures = ["down"]
    with override_settings(DOVECOTE_CRM_WEBHOOK_URL=crm.url):
        update = receive(bot, message_update(chat_id=4242, text="Is the bike still for sale?", message_id=1))

        # The router answered; the CRM's run has a task of its own.
        assert run_of(update, "auto_reply").state == RunState.DONE
        assert sandbox.sent_texts(token=bot.token, chat_id=4242) == ["Echo: Is the bike still for sale?"]
        assert execute(update, "crm_webhook") == "retry"
        crm_run = run_of(update, "crm_webhook")
        assert crm_run.state == RunState.RETRY
        assert crm_run.last_error_class == "transient"
        assert "503" in crm_run.last_error

        # The CRM is back: the retry (after its backoff) delivers the lead once.
        assert execute(update, "crm_webhook", due_now=True) == "done"

    assert run_of(update, "crm_webhook").outcome == "sent-to-crm"
    key = f"dovecote:{bot.pk}:{update.update_id}:crm"
    assert [p["key"] for p in crm.posts] == [key, key]
    assert crm.leads == {key: 1}
    lead = crm.posts[-1]["body"]
    assert lead["text"] == "Is the bike still for sale?"
    assert lead["chat_id"] == 4242
    assert lead["trace_id"] == update.trace_id


@pytest.mark.django_db
@override_settings(DOVECOTE_CRM_LOOKUP=CRM_LOOKUP)
def test_a_lead_stored_before_the_answer_was_lost_is_found_by_the_lookup_and_not_posted_again(
    bot, crm: FakeCRM
) -> None:
    crm.failures = ["lost_answer"]
    with override_settings(DOVECOTE_CRM_WEBHOOK_URL=crm.url):
        update = receive(bot, message_update(chat_id=5, text="call me", message_id=1))
        assert execute(update, "crm_webhook") == "retry"
        assert execute(update, "crm_webhook", due_now=True) == "done"

    assert len(crm.posts) == 1
    assert sum(crm.leads.values()) == 1
    assert run_of(update, "crm_webhook").outcome == "found-in-crm"


@pytest.mark.django_db
def test_without_a_lookup_hook_a_retry_resends_the_same_idempotency_key(bot, crm: FakeCRM) -> None:
    crm.failures = ["lost_answer"]
    with override_settings(DOVECOTE_CRM_WEBHOOK_URL=crm.url, DOVECOTE_CRM_LOOKUP=""):
        update = receive(bot, message_update(chat_id=5, text="call me", message_id=1))
        execute(update, "crm_webhook")
        execute(update, "crm_webhook", due_now=True)

    keys = [p["key"] for p in crm.posts]
    assert len(keys) == 2
    assert keys[0] == keys[1]  # a CRM that honours Idempotency-Key dedupes it


@pytest.mark.django_db
def test_a_crm_that_rejects_the_event_dead_letters_the_run_at_once(bot, crm: FakeCRM) -> None:
    crm.handle = lambda *args: (422, {"error": "bad phone"})  # type: ignore[method-assign]
    with override_settings(DOVECOTE_CRM_WEBHOOK_URL=crm.url):
        update = receive(bot, message_update(chat_id=5, text="hi", message_id=1))
        assert execute(update, "crm_webhook") == "dead-lettered"

    run = run_of(update, "crm_webhook")
    assert run.state == RunState.FAILED
    letter = DeadLetter.objects.get(consumer_run=run)
    assert letter.reason_class == "permanent"
    assert letter.trace_id == update.trace_id
    assert "422" in letter.last_error


# --- analytics -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_analytics_records_one_event_per_update_with_its_latency(bot) -> None:
    sent_at = int(timezone.now().timestamp()) - 3
    update = receive(
        bot, message_update(chat_id=-100200, text="hi all", message_id=9, chat_type="supergroup", date=sent_at)
    )
    assert run_of(update, "analytics").state == RunState.DONE  # run by the router
    # A re-run (a worker died after writing) adds nothing.
    ConsumerRun.objects.filter(pk=run_of(update, "analytics").pk).update(state=RunState.RETRY)
    execute(update, "analytics")

    event = AnalyticsEvent.objects.get()
    assert event.update == update
    assert (event.update_type, event.chat_id, event.chat_type) == ("message", -100200, "supergroup")
    assert 3000 <= event.latency_ms < 5000


@pytest.mark.django_db
def test_analytics_times_an_edit_of_an_old_message_from_the_edit_not_the_original_date(bot) -> None:
    now = int(timezone.now().timestamp())
    edited = message_update(chat_id=7, text="typo fixed", message_id=3, date=now - 60 * 86400)
    edited["edited_message"] = {**edited.pop("message"), "edit_date": now - 3}
    update = receive(bot, edited)

    assert run_of(update, "analytics").state == RunState.DONE  # run by the router

    event = AnalyticsEvent.objects.get(update=update)
    assert event.update_type == "edited_message"
    assert 3000 <= event.latency_ms < 5000
    assert event.message_date.timestamp() == now - 60 * 86400  # still the message's own date


@pytest.mark.django_db
def test_analytics_stores_no_latency_for_a_date_too_old_to_be_a_delivery_delay(bot) -> None:
    update = receive(bot, message_update(chat_id=7, text="from 1970", message_id=4, date=1))

    assert run_of(update, "analytics").state == RunState.DONE  # run by the router

    event = AnalyticsEvent.objects.get(update=update)
    assert event.latency_ms is None
    assert event.message_date.year == 1970


# --- replay, races, age ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_replay_of_a_finished_update_gets_no_second_reply_and_runs_nothing_again(bot, sandbox) -> None:
    payload = message_update(chat_id=31, text="once", message_id=1)
    update = receive(bot, payload)
    assert {run.consumer: run.state for run in update.runs.all()} == {
        "auto_reply": RunState.DONE,
        "analytics": RunState.DONE,
    }
    assert sandbox.sent_texts(token=bot.token) == ["Echo: once"]

    again, created = inbox_update_store(bot=bot, payload=payload)
    assert not created
    assert route(again) == []
    for run in update.runs.all():
        assert consumer_run_execute(run.pk) == "not-waiting"
    assert deliver(bot) == []
    assert InboundUpdate.objects.count() == 1
    assert OutboundMessage.objects.count() == 1
    assert AnalyticsEvent.objects.count() == 1
    assert sandbox.sent_texts(token=bot.token) == ["Echo: once"]


@pytest.fixture
def booking() -> Iterator[list[str]]:
    """A consumer behind an inline button "Book table 4": it books (an effect, once per
    press) and answers in the chat. Returns the keys of the bookings made."""
    booked: list[str] = []

    @registry.consumer("booking", update_types=["callback_query"])
    def booking(ctx: registry.ConsumerContext) -> str:
        press = ctx.update.payload["callback_query"]
        ctx.effect("book", lambda handle: booked.append(handle.key) or {"table": press["data"]})
        ctx.send(chat_id=ctx.update.chat_id, method="answerCallbackQuery", payload={"callback_query_id": press["id"]})
        ctx.reply(f"Booked: {press['data']}")
        return "booked"

    yield booked
    registry.unregister("booking")


@pytest.mark.django_db(transaction=True)
def test_a_key_per_press_not_per_chat_and_button_the_same_button_pressed_again_tomorrow_gets_a_new_answer(
    bot, sandbox, booking: list[str]
) -> None:
    today = sandbox.push_callback(bot.token, chat_id=44, data="table-4", message_id=1)["update"]
    first = receive(bot, today)
    assert execute(first, "booking") == "done"
    deliver(bot)  # what the run's worker could not send at once (the chat's pace)

    # The next day the same person presses the same button in the same chat: a new
    # callback query, a new intentional command. A key per chat and button would swallow it.
    tomorrow = sandbox.push_callback(bot.token, chat_id=44, data="table-4", message_id=1)["update"]
    assert tomorrow["callback_query"]["id"] != today["callback_query"]["id"]
    second = receive(bot, tomorrow)
    assert execute(second, "booking") == "done"
    deliver(bot)
    assert set(OutboundMessage.objects.filter(bot=bot).values_list("state", flat=True)) == {State.SENT}

    assert sandbox.sent_texts(token=bot.token, chat_id=44) == ["Booked: table-4", "Booked: table-4"]
    answered = sandbox.calls(token=bot.token, method="answerCallbackQuery")
    assert [c["params"]["callback_query_id"] for c in answered] == [
        today["callback_query"]["id"],
        tomorrow["callback_query"]["id"],
    ]
    assert len(set(booking)) == 2  # two bookings, each under its own key
    keys = set(OutboundMessage.objects.filter(bot=bot).values_list("idempotency_key", flat=True))
    assert len(keys) == 4

    # While a replay of either press (a redelivered update) does nothing at all.
    assert inbox_update_store(bot=bot, payload=tomorrow)[1] is False
    assert consumer_run_execute(run_of(second, "booking").pk) == "not-waiting"
    assert deliver(bot) == []
    assert len(booking) == 2


@pytest.fixture
def slow_counter() -> Iterator[list[int]]:
    calls: list[int] = []

    @registry.consumer("slow_counter", update_types=["message"])
    def slow_counter(ctx: registry.ConsumerContext) -> None:
        calls.append(ctx.update.update_id)
        time.sleep(0.3)

    yield calls
    registry.unregister("slow_counter")


@pytest.mark.django_db(transaction=True)
def test_two_workers_racing_on_one_run_execute_it_once(bot, slow_counter: list[int]) -> None:
    update = receive(bot, message_update(chat_id=8, text="race", message_id=1))
    run = run_of(update, "slow_counter")
    start = threading.Barrier(2)
    results: list[str] = []

    def worker() -> None:
        try:
            start.wait()
            results.append(consumer_run_execute(run.pk))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)

    assert slow_counter == [update.update_id]
    # The loser either lost the claim or came when the run was already done.
    assert len(results) == 2
    assert results.count("done") == 1
    assert set(results) - {"done"} <= {"claimed-elsewhere", "not-waiting"}
    run.refresh_from_db()
    assert (run.state, run.attempts) == (RunState.DONE, 1)


@pytest.mark.django_db
def test_a_run_older_than_its_max_age_is_cancelled_with_a_reason_not_run_late(bot, sandbox) -> None:
    # Routed late (the sweeper's redispatch after an outage): the router runs nothing late.
    update = store(bot, message_update(chat_id=12, text="from yesterday", message_id=1))
    InboundUpdate.objects.filter(pk=update.pk).update(received_at=timezone.now() - timedelta(hours=25))

    route(update)

    run = run_of(update, "auto_reply")
    assert run.state == RunState.CANCELLED
    assert "max age" in run.cancel_reason
    assert not OutboundMessage.objects.exists()
    assert sandbox.sent_texts(token=bot.token) == []


@pytest.mark.django_db
def test_a_run_whose_task_comes_after_its_max_age_is_cancelled_with_a_reason_not_run_late(bot, crm: FakeCRM) -> None:
    with override_settings(DOVECOTE_CRM_WEBHOOK_URL=crm.url):
        update = receive(bot, message_update(chat_id=12, text="call me", message_id=1))
        InboundUpdate.objects.filter(pk=update.pk).update(received_at=timezone.now() - timedelta(hours=25))

        assert execute(update, "crm_webhook") == "too-old"

    run = run_of(update, "crm_webhook")
    assert run.state == RunState.CANCELLED
    assert "max age" in run.cancel_reason
    assert crm.posts == []


@pytest.mark.django_db
def test_an_auth_error_pauses_the_consumer_and_keeps_its_runs(bot, crm: FakeCRM) -> None:
    refused: list[str] = []
    crm.handle = lambda *args: refused.append(args[0]) or (401, {"error": "bad api key"})  # type: ignore[method-assign]
    with override_settings(DOVECOTE_CRM_WEBHOOK_URL=crm.url, DOVECOTE_CIRCUIT_FIRST_PROBE_SECONDS=30):
        first = receive(bot, message_update(chat_id=1, text="a", message_id=1))
        second = receive(bot, message_update(chat_id=2, text="b", message_id=1))
        assert execute(first, "crm_webhook") == "paused"
        assert execute(second, "crm_webhook") == "circuit-open"

    paused, waiting = run_of(first, "crm_webhook"), run_of(second, "crm_webhook")
    assert (paused.state, paused.last_error_class) == (RunState.RETRY, "auth")
    assert waiting.state == RunState.PENDING
    assert waiting.next_attempt_at > timezone.now() + timedelta(seconds=10)  # woken at the probe
    assert refused == ["POST"]  # the second run did not knock again while paused
    assert not DeadLetter.objects.exists()


# --- the openai responder --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_openai_responder_sends_the_models_answer_with_the_chats_history(
    bot_factory, sandbox, model: FakeOpenAI
) -> None:
    shop = bot_factory(responder="openai", openai_model="shop-model-7b", system_prompt="You sell bikes.")
    with override_settings(
        OPENAI_BASE_URL=model.base_url, OPENAI_API_KEY="sk-test-key", DOVECOTE_OPENAI_MODEL="default-model"
    ):
        first = receive(shop, message_update(chat_id=77, text="Hi", message_id=1))
        model.reply = "Hello! How can I help?"
        assert execute(first, "auto_reply") == "done"  # a model's run has a task of its own
        assert sandbox.sent_texts(token=shop.token, chat_id=77) == ["Hello! How can I help?"]

        model.reply = "Yes, it is still available."
        second = receive(shop, message_update(chat_id=77, text="Is the red bike still available?", message_id=3))
        assert execute(second, "auto_reply") == "done"
        deliver(shop)  # the answer, if the chat's one message a second kept it from going at once

    assert sandbox.sent_texts(token=shop.token, chat_id=77) == ["Hello! How can I help?", "Yes, it is still available."]
    request = model.requests[-1]
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == "Bearer sk-test-key"
    assert request["body"]["model"] == "shop-model-7b"
    assert request["body"]["messages"] == [
        {"role": "system", "content": "You sell bikes."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Is the red bike still available?"},
    ]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("status", "result", "state", "error_class"),
    [
        (503, "retry", RunState.RETRY, "transient"),
        (400, "dead-lettered", RunState.FAILED, "permanent"),
        (401, "paused", RunState.RETRY, "auth"),
    ],
)
def test_model_errors_are_classified(bot_factory, model: FakeOpenAI, status, result, state, error_class) -> None:
    shop = bot_factory(responder="openai")
    model.statuses = [status]
    with override_settings(OPENAI_BASE_URL=model.base_url):
        update = receive(shop, message_update(chat_id=3, text="hello?", message_id=1))
        assert execute(update, "auto_reply") == result
    run = run_of(update, "auto_reply")
    assert (run.state, run.last_error_class) == (state, error_class)
    assert not OutboundMessage.objects.exists()


@pytest.mark.django_db
def test_a_model_that_times_out_is_retried_later(bot_factory, model: FakeOpenAI) -> None:
    shop = bot_factory(responder="openai")
    release = threading.Event()
    original = model.handle

    def slow(*args):
        release.wait(3)
        return original(*args)

    model.handle = slow  # type: ignore[method-assign]
    try:
        with override_settings(OPENAI_BASE_URL=model.base_url, DOVECOTE_OPENAI_TIMEOUT=0.3):
            update = receive(shop, message_update(chat_id=3, text="hello?", message_id=1))
            assert execute(update, "auto_reply") == "retry"
    finally:
        release.set()
    assert "unreachable" in run_of(update, "auto_reply").last_error


# --- replies longer than Telegram allows -----------------------------------------------------


def _joined_with_one_cut(parts: list[str], full: str) -> bool:
    """The parts are `full` cut once, the whitespace at the cut removed."""
    first, second = parts
    return full.startswith(first) and full.endswith(second) and not full[len(first) : -len(second)].strip()


@pytest.mark.django_db(transaction=True)
def test_an_echo_of_a_4090_character_message_arrives_as_two_messages_in_order(bot, sandbox) -> None:
    # 4,090 characters, five of them emoji: 4,095 UTF-16 units, which Telegram accepts from a
    # person; "Echo: " makes the answer 4,101 units, over Telegram's 4,096.
    original = "😀" * 5 + " " + ("abcd " * 1000)[:4084]
    assert len(original) == 4090
    update = receive(bot, message_update(chat_id=77, text=original, message_id=1))

    # The router answered and sent the first part; the second waits for the chat's pace.
    assert deliver(bot) == ["sent"]

    texts = sandbox.sent_texts(token=bot.token, chat_id=77)
    assert len(texts) == 2
    assert all(len(t.encode("utf-16-le")) // 2 <= 4096 for t in texts)
    assert _joined_with_one_cut(texts, "Echo: " + original)
    assert run_of(update, "auto_reply").state == RunState.DONE
    assert not DeadLetter.objects.exists()
    messages = list(OutboundMessage.objects.order_by("pk"))
    assert [m.idempotency_key for m in messages] == [
        f"upd:{update.update_id}:auto_reply:0",
        f"upd:{update.update_id}:auto_reply:0#2",
    ]
    assert messages[0].telegram_message_id < messages[1].telegram_message_id

    # The run again (a redelivered task) writes nothing new and sends nothing twice.
    assert consumer_run_execute(run_of(update, "auto_reply").pk) == "not-waiting"
    assert deliver(bot) == []


@pytest.mark.django_db(transaction=True)
@override_settings(DOVECOTE_REPLY_DEBOUNCE_SECONDS=0.3)
def test_a_coalesced_burst_longer_than_one_message_is_answered_in_parts_cut_between_messages(bot, sandbox) -> None:
    first_text, second_text = "a" * 3000, "b" * 3000
    first = store(bot, message_update(chat_id=78, text=first_text, message_id=1))
    second = store(bot, message_update(chat_id=78, text=second_text, message_id=2))
    assert route_all(bot) == 2  # one router pass
    assert run_of(first, "auto_reply").outcome == "coalesced"  # into the second's answer
    run = run_of(second, "auto_reply")
    assert run.state == RunState.PENDING  # deferred until the chat is quiet
    time.sleep(max(0.0, (run.next_attempt_at - timezone.now()).total_seconds()) + 0.02)

    assert execute(second, "auto_reply") == "done"
    assert deliver(bot) == ["sent"]  # the second part, after the chat's pace

    # The echo is one line per message: the cut falls at the line break between them.
    assert sandbox.sent_texts(token=bot.token, chat_id=78) == ["Echo: " + first_text, second_text]
    assert run_of(second, "auto_reply").outcome == "answered 2"
    assert not DeadLetter.objects.exists()


@pytest.fixture
def long_caption_consumer() -> Iterator[None]:
    @registry.consumer("long_caption", update_types=["message"])
    def long_caption(ctx: registry.ConsumerContext) -> None:
        ctx.send(chat_id=ctx.update.chat_id, method="sendPhoto", payload={"photo": "f", "caption": "x" * 1025})

    yield
    registry.unregister("long_caption")


@pytest.mark.django_db
@pytest.mark.usefixtures("long_caption_consumer")
def test_a_reply_the_outbox_refuses_dead_letters_the_run_at_once_instead_of_retrying(bot) -> None:
    update = receive(bot, message_update(chat_id=79, text="photo please", message_id=1))

    assert execute(update, "long_caption") == "dead-lettered"

    run = run_of(update, "long_caption")
    assert (run.state, run.attempts) == (RunState.FAILED, 1)
    letter = DeadLetter.objects.get(consumer_run=run)
    assert letter.reason_class == "permanent"
    assert "Telegram allows 1024" in letter.last_error
    assert not OutboundMessage.objects.filter(consumer="long_caption").exists()


@pytest.mark.django_db
def test_a_long_model_answer_is_sent_whole_in_parts_not_cut_off(bot_factory, sandbox, model: FakeOpenAI) -> None:
    shop = bot_factory(responder="openai", openai_model="shop-model-7b")
    model.reply = "First paragraph. " * 200 + "\n\n" + "Second paragraph. " * 100 + "The end."
    with override_settings(OPENAI_BASE_URL=model.base_url):
        update = receive(shop, message_update(chat_id=80, text="Tell me everything", message_id=1))
        assert execute(update, "auto_reply") == "done"
        assert deliver(shop) == ["sent", "sent"]

    texts = sandbox.sent_texts(token=shop.token, chat_id=80)
    assert texts == [("First paragraph. " * 200).strip(), "Second paragraph. " * 100 + "The end."]


answers: list[str] = []


@pytest.fixture
def fickle_model_consumer() -> Iterator[None]:
    """A model that answers differently each time, and fails after its first answer."""

    @registry.consumer("fickle_model", update_types=["message"])
    def fickle_model(ctx: registry.ConsumerContext) -> None:
        answers.append(f"answer {len(answers) + 1}")
        ctx.reply(answers[-1])
        if len(answers) == 1:
            raise registry.TransientError("the model timed out after writing its answer")

    answers.clear()
    yield
    registry.unregister("fickle_model")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("fickle_model_consumer")
def test_a_retry_that_writes_another_answer_under_the_same_key_keeps_the_first(bot_factory, sandbox) -> None:
    bot = bot_factory(responder="none")  # the model's answer is the chat's only one
    update = receive(bot, message_update(chat_id=81, text="hello", message_id=1))

    assert execute(update, "fickle_model") == "retry"
    assert execute(update, "fickle_model", due_now=True) == "done"
    deliver(bot)

    assert answers == ["answer 1", "answer 2"]
    assert sandbox.sent_texts(token=bot.token) == ["answer 1"]
    assert OutboundMessage.objects.filter(consumer="fickle_model").count() == 1
