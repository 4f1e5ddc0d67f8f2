"""Inline work on the hot path (DOVECOTE_INLINE_WORK): the router runs the consumers that
declared themselves inline-safe in its own task, and a consumer's reply leaves from the
worker that wrote it, right after its commit, when the bot has room. Every run and message
is still a row with its states; what cannot go now is handed to a task or the drain as
before. Real PostgreSQL, Redis (the broker's queue read back) and the sandbox."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.test import override_settings
from django.utils import timezone

from bots import registry, routing
from bots import runs as consumer_runs
from bots.inbox import inbox_update_store
from bots.models import ConsumerRun, RunState
from outbox import ratelimit
from outbox.models import OutboundMessage, State
from tests.bots.fakes import answered, message_update
from tests.support import queued, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inline_work")]


@pytest.fixture
def inline_work():
    with override_settings(DOVECOTE_INLINE_WORK=True):
        yield


def inbox_updates_route(bot_id: int) -> int:
    """A router pass, returning once its inline sends' answers are recorded (on a busy host
    a send may leave a slow answer to the late-answers thread)."""
    routed = routing.inbox_updates_route(bot_id)
    answered()
    return routed


def consumer_run_execute(run_pk: int) -> str:
    outcome = consumer_runs.consumer_run_execute(run_pk)
    answered()
    return outcome


def queued_names() -> list[str]:
    return [task.name for task in queued()]


def store(bot, chat_id: int, message_id: int, text: str = "hi") -> None:
    inbox_update_store(bot=bot, payload=message_update(chat_id=chat_id, text=text, message_id=message_id))


def test_the_router_runs_echo_and_analytics_itself_and_the_echo_leaves_without_a_task(bot, sandbox) -> None:
    store(bot, 501, 1, "ping")
    store(bot, 502, 2, "pong")
    before = set(queued_names())

    assert inbox_updates_route(bot.pk) == 2

    runs = ConsumerRun.objects.filter(update__bot=bot)
    assert {(r.consumer, r.state) for r in runs} == {("auto_reply", RunState.DONE), ("analytics", RunState.DONE)}
    assert sorted(sandbox.sent_texts(token=bot.token)) == ["Echo: ping", "Echo: pong"]
    assert set(OutboundMessage.objects.filter(bot=bot).values_list("state", flat=True)) == {State.SENT}
    assert set(queued_names()) - before == set()  # no run task, no send task, no drain


def test_a_model_answer_keeps_its_own_task(bot_factory, sandbox) -> None:
    shop = bot_factory(responder="openai")
    store(shop, 503, 1)

    inbox_updates_route(shop.pk)

    reply_run = ConsumerRun.objects.get(update__bot=shop, consumer="auto_reply")
    assert reply_run.state == RunState.PENDING
    assert ConsumerRun.objects.get(update__bot=shop, consumer="analytics").state == RunState.DONE
    assert [t.args for t in queued() if t.name == "bots.run_consumer"] == [[reply_run.pk]]


def test_a_consumers_reply_is_sent_by_its_worker_right_after_the_run(bot, sandbox) -> None:
    with override_settings(DOVECOTE_INLINE_WORK=False):
        store(bot, 504, 1, "echo me")
        inbox_updates_route(bot.pk)  # runs queued, none run yet
    run = ConsumerRun.objects.get(update__bot=bot, consumer="auto_reply")

    assert consumer_run_execute(run.pk) == "done"

    assert sandbox.sent_texts(token=bot.token) == ["Echo: echo me"]
    assert "outbox.drain_bot" not in queued_names()


def test_without_room_now_the_reply_goes_to_the_drain_untouched(bot_factory, sandbox) -> None:
    slow = bot_factory(rate_limit=1)
    ratelimit.reserve_slot(slow.pk, slow.rate_limit, horizon=5)  # the bot's slot for now is taken
    with override_settings(DOVECOTE_INLINE_WORK=False):
        store(slow, 505, 1, "later")
        inbox_updates_route(slow.pk)
    run = ConsumerRun.objects.get(update__bot=slow, consumer="auto_reply")

    assert consumer_run_execute(run.pk) == "done"

    reply = OutboundMessage.objects.get(bot=slow)
    assert (reply.state, reply.attempts) == (State.PENDING, 0)
    assert reply.next_attempt_at <= timezone.now()  # not deferred: still due, for the drain
    assert sandbox.sent_texts(token=slow.token) == []
    assert "outbox.drain_bot" in queued_names()


def test_an_update_run_here_logs_one_info_line_with_its_trace_id(bot, sandbox, caplog) -> None:
    store(bot, 506, 1, "log me")
    with caplog.at_level("INFO", logger="bots.routing"):
        inbox_updates_route(bot.pk)

    update = ConsumerRun.objects.filter(update__bot=bot).first().update
    lines = [r for r in caplog.records if r.name == "bots.routing" and r.levelname == "INFO"]
    assert [r.getMessage() for r in lines] == [
        f"update {update.update_id} routed to auto_reply, analytics; ran here: auto_reply done, analytics done"
    ]
    assert lines[0].trace_id == update.trace_id


@pytest.fixture
def picky_consumer() -> Iterator[None]:
    """An inline-safe consumer that fails on "boom" and answers everything else."""

    @registry.consumer("picky", update_types=["message"], max_attempts=3, inline=True)
    def picky(ctx: registry.ConsumerContext) -> str:
        if ctx.text == "boom":
            raise registry.TransientError("picky does not like boom")
        return "liked"

    yield
    registry.unregister("picky")


def test_a_batch_runs_its_inline_runs_together_and_a_failure_is_settled_for_its_run_alone(
    bot_factory, sandbox, picky_consumer, django_assert_max_num_queries
) -> None:
    bot = bot_factory(rate_limit=1000)  # room for the six replies at once (a paid broadcast bot)
    for n, text in enumerate(["one", "boom", "three", "four", "five", "six"], start=1):
        store(bot, 600 + n, n, text)

    # 6 updates, 18 runs: claimed together, done together, the six replies sent as one batch
    # (one at a time, this was ~120 statements).
    with django_assert_max_num_queries(45):
        assert inbox_updates_route(bot.pk) == 6

    runs = {(r.update.message_id, r.consumer): r for r in ConsumerRun.objects.filter(update__bot=bot)}
    failed = runs.pop((2, "picky"))
    assert (failed.state, failed.attempts, failed.last_error_class) == (RunState.RETRY, 1, "transient")
    assert "picky does not like boom" in failed.last_error
    assert {(r.state, r.attempts) for r in runs.values()} == {(RunState.DONE, 1)}
    assert {r.outcome for k, r in runs.items() if k[1] == "picky"} == {"liked"}
    assert sorted(sandbox.sent_texts(token=bot.token)) == sorted(
        f"Echo: {t}" for t in ["one", "boom", "three", "four", "five", "six"]
    )
    assert set(OutboundMessage.objects.filter(bot=bot).values_list("state", "attempts")) == {(State.SENT, 1)}
    assert [t.args for t in queued() if t.name == "bots.run_consumer"] == [[failed.pk]]  # its retry


def test_a_batch_sends_what_the_bot_has_room_for_and_hands_the_rest_to_the_drain(bot_factory, sandbox) -> None:
    slow = bot_factory(rate_limit=1)
    for n in range(1, 4):
        store(slow, 700 + n, n, f"m{n}")

    inbox_updates_route(slow.pk)

    assert len(sandbox.sent_texts(token=slow.token)) == 1  # the bot's one slot for now
    waiting = OutboundMessage.objects.filter(bot=slow, state=State.PENDING)
    assert {(m.attempts, m.next_attempt_at <= timezone.now()) for m in waiting} == {(0, True)}
    assert waiting.count() == 2
    assert queued_names().count("outbox.drain_bot") == 1  # one wake-up for both


def test_replies_to_one_chat_in_one_batch_keep_their_order(bot, sandbox) -> None:
    store(bot, 801, 1, "first")
    store(bot, 801, 2, "second")

    inbox_updates_route(bot.pk)

    # The second waits for the first (the chat's order); the bot's drain sends it next.
    assert sandbox.sent_texts(token=bot.token) == ["Echo: first"]
    second = OutboundMessage.objects.get(bot=bot, state=State.PENDING)
    assert second.payload["text"] == "Echo: second"
    assert "outbox.drain_bot" in queued_names()


def test_a_big_batchs_first_replies_leave_before_its_last_runs(bot_factory, sandbox) -> None:
    fast = bot_factory(rate_limit=1000)
    seen_at_last_run: list[int] = []

    @registry.consumer("late_witness", update_types=["message"], inline=True)
    def late_witness(ctx: registry.ConsumerContext) -> str:
        if ctx.text == "m12":
            seen_at_last_run.append(len(sandbox.sent_texts(token=fast.token)))
        return "seen"

    try:
        for n in range(1, 13):
            store(fast, 900 + n, n, f"m{n}")
        assert inbox_updates_route(fast.pk) == 12
    finally:
        registry.unregister("late_witness")

    # A drain's batch of replies (8) went out while the batch's later runs were still to run.
    assert len(seen_at_last_run) == 1
    assert seen_at_last_run[0] >= 8
    assert len(sandbox.sent_texts(token=fast.token)) == 12


def test_a_reply_that_waits_for_its_chat_in_a_big_batch_is_handed_on_not_dropped(bot_factory, sandbox) -> None:
    # Found by bench/sidebyside.py: a few replies of a burst stayed pending until the
    # sweeper. A full send batch leaves while the router's batch still runs; a reply in it
    # that must wait for its chat's earlier reply was handed on into that batch's list,
    # which was then cleared.
    fast = bot_factory(rate_limit=1000)
    store(fast, 1801, 1, "first")
    store(fast, 1801, 2, "second")
    for n in range(3, 13):
        store(fast, 1800 + n, n, f"m{n}")

    assert inbox_updates_route(fast.pk) == 12

    texts = sandbox.sent_texts(token=fast.token)
    waiting = OutboundMessage.objects.filter(bot=fast).exclude(state=State.SENT)
    # Every reply went, or waits with the bot's drain woken for it.
    assert len(texts) + waiting.count() == 12
    assert "Echo: first" in texts
    if waiting.exists():
        assert [m.payload["text"] for m in waiting] == ["Echo: second"]
        assert "outbox.drain_bot" in queued_names()
    else:
        assert texts.index("Echo: first") < texts.index("Echo: second")


def test_an_inline_consumer_paused_by_an_operator_is_not_run_by_the_router(bot, sandbox) -> None:
    # The router reads the circuits of the inline consumers with the updates (one statement).
    from outbox import circuits

    circuits.pause(circuits.consumer_scope("auto_reply"), reason="an operator holds the replies")
    store(bot, 521, 1, "held back")

    assert inbox_updates_route(bot.pk) == 1

    runs = {r.consumer: r for r in ConsumerRun.objects.filter(update__bot=bot)}
    assert runs["analytics"].state == RunState.DONE
    assert runs["auto_reply"].state == RunState.PENDING
    assert runs["auto_reply"].attempts == 0
    assert sandbox.sent_texts(token=bot.token) == []
    assert not OutboundMessage.objects.filter(bot=bot).exists()

    circuits.resume(circuits.consumer_scope("auto_reply"))
    assert consumer_run_execute(runs["auto_reply"].pk) == "done"
    assert sandbox.sent_texts(token=bot.token) == ["Echo: held back"]


def test_an_inline_consumer_with_failures_on_record_runs_and_its_success_forgets_them(bot, sandbox) -> None:
    from outbox import circuits
    from outbox.models import Circuit, CircuitState

    scope = circuits.consumer_scope("auto_reply")
    circuits.record_failure(scope, reason="a blip")
    store(bot, 522, 1, "after a blip")

    assert inbox_updates_route(bot.pk) == 1

    assert ConsumerRun.objects.get(update__bot=bot, consumer="auto_reply").state == RunState.DONE
    assert sandbox.sent_texts(token=bot.token) == ["Echo: after a blip"]
    circuit = Circuit.objects.get(scope=scope)
    assert (circuit.state, circuit.consecutive_failures) == (CircuitState.CLOSED, 0)


def test_a_batchs_replies_guards_and_events_are_written_in_one_statement_each(bot_factory, sandbox) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from bots.models import AnalyticsEvent, ChatState

    fast = bot_factory(rate_limit=1000)
    for n in range(1, 21):
        store(fast, 1900 + n, n, f"m{n}")
    store(fast, 1901, 21, "m1 again")  # a second message of one chat in the same batch

    with CaptureQueriesContext(connection) as statements:
        assert inbox_updates_route(fast.pk) == 21

    inserts = [q["sql"].split("(")[0].split()[-1].strip('"') for q in statements if q["sql"].startswith("INSERT")]
    assert sorted(inserts) == ["bots_analyticsevent", "bots_chatstate", "outbox_outboundmessage"]
    assert AnalyticsEvent.objects.filter(bot=fast).count() == 21
    guards = dict(ChatState.objects.filter(bot=fast).values_list("chat_id", "last_answered_message_id"))
    assert guards == {1900 + n: n for n in range(2, 21)} | {1901: 21}
    replies = list(OutboundMessage.objects.filter(bot=fast).order_by("pk").values_list("payload__text", flat=True))
    assert replies == [f"Echo: m{n}" for n in range(1, 21)] + ["Echo: m1 again"]  # ids follow the updates
    assert ConsumerRun.objects.filter(update__bot=fast, state=RunState.DONE).count() == 42
    # Every reply went but the chat's second, which waits for the chat's one message a second.
    assert sorted(sandbox.sent_texts(token=fast.token)) == sorted(replies[:20])
    assert OutboundMessage.objects.get(bot=fast, state=State.PENDING).payload == {"text": "Echo: m1 again"}


def test_a_chats_guard_moves_once_its_reply_is_out_so_the_request_does_not_wait_for_it(bot_factory, sandbox) -> None:
    from bots.models import ChatState

    fast = bot_factory(rate_limit=1000)
    store(fast, 2101, 1, "alone")  # a lone update: the single run's path
    assert inbox_updates_route(fast.pk) == 1
    store(fast, 2102, 2, "a")
    store(fast, 2103, 3, "b")  # two at once: the consumer's batch form
    assert inbox_updates_route(fast.pk) == 2

    arrived = {int(c["params"]["chat_id"]): c["at"] for c in sandbox.calls(token=fast.token, method="sendMessage")}
    guards = {g.chat_id: g for g in ChatState.objects.filter(bot=fast)}
    assert {chat: g.last_answered_message_id for chat, g in guards.items()} == {2101: 1, 2102: 2, 2103: 3}
    # Each guard was written after the sandbox had its chat's reply: one statement fewer
    # between the reply's row and its request.
    assert all(g.last_answered_at.timestamp() >= arrived[chat] for chat, g in guards.items())


@pytest.fixture
def half_batch_consumer() -> Iterator[list[int]]:
    """An inline consumer whose batch form writes two replies, then fails; alone it answers
    every update but "bad", which it refuses for good. Yields the batch calls' sizes."""
    calls: list[int] = []

    def tally_batch(ctxs: list[registry.ConsumerContext]) -> list[str]:
        calls.append(len(ctxs))
        registry.replies([(ctx, f"tally: {ctx.text}") for ctx in ctxs[:2]])
        raise RuntimeError("the batch broke halfway")

    @registry.consumer("tally", update_types=["message"], max_attempts=3, inline=True, batch=tally_batch)
    def tally(ctx: registry.ConsumerContext) -> str:
        if ctx.text == "bad":
            raise registry.PermanentError("tally refuses bad")
        ctx.reply(f"tally: {ctx.text}")
        return "tallied"

    yield calls
    registry.unregister("tally")


def test_a_batch_that_fails_runs_one_by_one_and_writes_nothing_twice(bot_factory, sandbox, half_batch_consumer) -> None:
    from outbox.models import DeadLetter

    fast = bot_factory(rate_limit=1000)
    for n, text in enumerate(["a", "b", "bad", "d"], start=1):
        store(fast, 2000 + n, n, text)

    assert inbox_updates_route(fast.pk) == 4

    assert half_batch_consumer == [4]  # the batch ran once, then each run alone
    runs = {r.update.text: r for r in ConsumerRun.objects.filter(update__bot=fast, consumer="tally")}
    assert {t: (r.state, r.attempts) for t, r in runs.items()} == {
        "a": (RunState.DONE, 1),
        "b": (RunState.DONE, 1),
        "bad": (RunState.FAILED, 1),
        "d": (RunState.DONE, 1),
    }
    assert DeadLetter.objects.get(consumer_run=runs["bad"]).reason_class == "permanent"
    # The batch's two replies are found by their keys, not written again (each chat's echo
    # went first; these wait for the chat's one message a second).
    tallies = OutboundMessage.objects.filter(bot=fast, payload__text__startswith="tally:")
    assert sorted(tallies.values_list("payload__text", flat=True)) == ["tally: a", "tally: b", "tally: d"]


# --- a reply written claimed (outbox.transitions.write_claimed) -----------------------


def test_a_lone_echos_reply_is_written_claimed_so_no_claim_comes_between_its_row_and_its_request(
    bot_factory, sandbox
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    fast = bot_factory(rate_limit=1000)
    store(fast, 2201, 1, "alone")

    with CaptureQueriesContext(connection) as statements:
        assert inbox_updates_route(fast.pk) == 1

    sql = [q["sql"] for q in statements]
    assert not [s for s in sql if "SET state = 'sending'" in s]  # no claim statement
    writes = [s for s in sql if s.startswith('INSERT INTO "outbox_outboundmessage"')]
    assert len(writes) == 1
    assert "THEN 'sending'" in writes[0]
    reply = OutboundMessage.objects.get(bot=fast)
    assert (reply.state, reply.attempts, reply.lease_owner) == (State.SENT, 1, "")
    assert reply.attempt_set.count() == 1
    assert sandbox.sent_texts(token=fast.token) == ["Echo: alone"]


def test_a_batchs_replies_are_written_claimed_in_one_statement_but_a_chats_second_waits_for_its_first(
    bot_factory, sandbox
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    fast = bot_factory(rate_limit=1000)
    store(fast, 2251, 1, "a")
    store(fast, 2252, 2, "b")
    store(fast, 2251, 3, "a again")  # the same chat: its reply cannot be claimed beside the first

    with CaptureQueriesContext(connection) as statements:
        assert inbox_updates_route(fast.pk) == 3

    sql = [q["sql"] for q in statements]
    writes = [s for s in sql if s.startswith('INSERT INTO "outbox_outboundmessage"')]
    assert len(writes) == 1
    assert "THEN 'sending'" in writes[0]
    # The two written claimed needed no claim; the third's claim finds its chat busy.
    assert len([s for s in sql if "SET state = 'sending'" in s]) <= 1
    assert sorted(sandbox.sent_texts(token=fast.token)) == ["Echo: a", "Echo: b"]
    second = OutboundMessage.objects.get(bot=fast, payload__text="Echo: a again")
    assert (second.state, second.attempts, second.lease_owner) == (State.PENDING, 0, "")
    sent = OutboundMessage.objects.filter(bot=fast, state=State.SENT)
    assert sorted(m.attempt_set.count() for m in sent) == [1, 1]
    assert "outbox.drain_bot" in queued_names()


def test_a_reply_to_a_chat_with_an_earlier_message_open_is_written_waiting_and_goes_after_it(
    bot_factory, sandbox
) -> None:
    from outbox.sending.batch import outbound_messages_drain
    from outbox.services import outbound_message_enqueue

    fast = bot_factory(rate_limit=1000)
    earlier, _ = outbound_message_enqueue(bot_id=fast.pk, chat_id=2301, payload={"text": "first"}, idempotency_key="e1")
    assert earlier.state == State.PENDING  # no worker has taken it yet
    store(fast, 2301, 1, "second")

    assert inbox_updates_route(fast.pk) == 1

    reply = OutboundMessage.objects.get(bot=fast, payload__text="Echo: second")
    assert (reply.state, reply.attempts, reply.lease_owner) == (State.PENDING, 0, "")
    assert sandbox.sent_texts(token=fast.token) == []
    outbound_messages_drain(fast.pk)  # the drain its wake-up published
    assert sandbox.sent_texts(token=fast.token) == ["first"]

    def drained_in_order() -> bool:
        outbound_messages_drain(fast.pk)  # the chat's next message, once its gate (1 s) opens
        return len(sandbox.sent_texts(token=fast.token)) >= 2

    wait_until(drained_in_order, timeout=10, message="the reply followed the earlier message")
    assert sandbox.sent_texts(token=fast.token) == ["first", "Echo: second"]


def test_a_reply_of_a_bot_whose_circuit_is_open_is_written_waiting_not_claimed(bot_factory, sandbox) -> None:
    from outbox import circuits
    from outbox.models import Circuit, CircuitState

    fast = bot_factory(rate_limit=1000)
    Circuit.objects.create(scope=circuits.bot_scope(fast.pk), state=CircuitState.OPEN, consecutive_failures=5)
    store(fast, 2401, 1, "held")

    assert inbox_updates_route(fast.pk) == 1

    reply = OutboundMessage.objects.get(bot=fast)
    assert (reply.state, reply.attempts, reply.lease_owner) == (State.PENDING, 0, "")
    assert sandbox.sent_texts(token=fast.token) == []


def test_a_message_written_claimed_whose_commit_comes_after_its_holding_block_is_let_go_for_the_drain(
    bot_factory,
) -> None:
    from django.db import transaction

    from outbox import dispatch
    from outbox.services import outbound_message_enqueue

    fast = bot_factory(rate_limit=1000)
    with transaction.atomic():
        with dispatch.holding() as held:
            message, created = outbound_message_enqueue(
                bot_id=fast.pk, chat_id=2501, payload={"text": "late commit"}, idempotency_key="late"
            )
        assert created
        assert message.state == State.SENDING  # written claimed, not committed yet
    # Committed after the block: nobody here sends it, so it waits for the drain, unclaimed.
    assert list(held) == []
    row = OutboundMessage.objects.get(pk=message.pk)
    assert (row.state, row.attempts, row.lease_owner, row.lease_expires_at) == (State.PENDING, 0, "", None)
    assert "outbox.drain_bot" in queued_names()


def test_the_same_key_written_twice_in_holding_blocks_is_one_message_sent_once(bot_factory, sandbox) -> None:
    from outbox import dispatch
    from outbox.sending import single
    from outbox.services import outbound_message_enqueue

    fast = bot_factory(rate_limit=1000)
    for _ in range(2):
        with dispatch.holding() as held:
            outbound_message_enqueue(bot_id=fast.pk, chat_id=2601, payload={"text": "once"}, idempotency_key="k1")
        single.send_held(held)
    assert OutboundMessage.objects.filter(bot=fast).count() == 1
    assert OutboundMessage.objects.get(bot=fast).state == State.SENT
    assert sandbox.sent_texts(token=fast.token) == ["once"]


def test_the_same_key_twice_in_one_batch_written_claimed_is_one_message_sent_once(bot_factory, sandbox) -> None:
    from outbox import dispatch
    from outbox.sending import single
    from outbox.services import outbound_messages_enqueue

    fast = bot_factory(rate_limit=1000)
    call = {"bot_id": fast.pk, "chat_id": 2651, "payload": {"text": "once"}, "idempotency_key": "k2"}
    with dispatch.holding() as held:
        first, second = outbound_messages_enqueue([call, dict(call)])
    single.send_held(held)

    assert (first.created, second.created) == (True, False)  # the second is the first's row
    assert first.message.pk == second.message.pk
    message = OutboundMessage.objects.get(bot=fast)
    assert (message.state, message.attempt_set.count()) == (State.SENT, 1)
    assert sandbox.sent_texts(token=fast.token) == ["once"]


def test_an_echo_waits_for_the_disk_only_at_its_attempt_row_and_its_sent_mark(bot_factory, sandbox) -> None:
    """The routing, the reply's row, the claims, the guard, the event and the done marks
    commit asynchronously (core/rows.py); the attempt row, whose commit comes before any
    request and carries every earlier write to the disk with it, and the sent mark do not."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    fast = bot_factory(rate_limit=1000)
    store(fast, 2301, 1, "alone")  # a lone update: its reply written claimed
    with CaptureQueriesContext(connection) as lone:
        assert inbox_updates_route(fast.pk) == 1
    store(fast, 2302, 2, "a")
    store(fast, 2303, 3, "b")  # a batch: the replies written claimed, in one statement
    with CaptureQueriesContext(connection) as batch:
        assert inbox_updates_route(fast.pk) == 2

    for statements in (lone, batch):
        writes = [" ".join(q["sql"].split()) for q in statements if not q["sql"].lstrip().startswith("SELECT")]
        waiting = [w for w in writes if not w.endswith("/* async commit */")]
        assert len(waiting) == 2, waiting
        assert "SET attempts = attempts + 1" in waiting[0]  # the attempt row, before the request
        assert "SET state = 'sent'" in waiting[1]
        not_waiting = " ".join(w for w in writes if w.endswith("/* async commit */"))
        assert "UPDATE bots_inboundupdate" in not_waiting  # the routing
        assert 'INSERT INTO "outbox_outboundmessage"' in not_waiting
        assert "INSERT INTO bots_chatstate" in not_waiting
        assert 'INSERT INTO "bots_analyticsevent"' in not_waiting
        assert "UPDATE bots_consumerrun AS r SET state" in not_waiting  # the done marks
    assert not [q["sql"] for q in batch if "SET state = 'sending'" in q["sql"]]  # no claim statement
    written = [q["sql"] for q in batch if q["sql"].startswith('INSERT INTO "outbox_outboundmessage"')]
    assert len(written) == 1
    assert "THEN 'sending'" in written[0]
    assert written[0].endswith("/* async commit */")
    assert sorted(sandbox.sent_texts(token=fast.token)) == ["Echo: a", "Echo: alone", "Echo: b"]
    assert ConsumerRun.objects.filter(update__bot=fast, state=RunState.DONE).count() == 6
