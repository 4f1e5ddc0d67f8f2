"""Prometheus metrics (issue 12): each counter moves for its event, through the real send
path, PostgreSQL and the sandbox; a scrape costs a fixed number of queries."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from prometheus_client import REGISTRY

from bots.models import Bot, ConsumerRun, InboundUpdate
from bots.routing import inbox_update_route
from bots.runs import consumer_run_execute
from core import metrics
from outbox.models import OutboundMessage, State
from outbox.sending.single import outbound_message_send
from outbox.services import outbound_message_enqueue
from reconciliation.sweeper import sweep
from tests.bots.fakes import route
from tests.bots.test_webhook import SECRET_HEADER, message_update
from tests.conftest import make_bot
from tests.reconciliation.test_cases import lost_answer
from tests.reconciliation.triage_helpers import failed_by_sandbox
from tests.support import METRICS_AUTH, base_env, wait_until

pytestmark = pytest.mark.django_db


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Moves:
    """The change of one sample across a block."""

    def __init__(self, name: str, **labels: str) -> None:
        self.name, self.labels = name, labels

    def __enter__(self) -> Moves:
        self.before = value(self.name, **self.labels)
        return self

    def __exit__(self, *exc: object) -> None:
        self.by = value(self.name, **self.labels) - self.before


def post_update(client: Client, bot, update_id: int):
    return client.post(
        bot.webhook_path,
        data=message_update(update_id, "hi"),
        content_type="application/json",
        headers={SECRET_HEADER: bot.webhook_secret},
    )


def stored_update(client: Client, bot_factory) -> tuple[Bot, InboundUpdate]:
    """A bot, and an update its webhook stored."""
    bot = bot_factory(webhook_secret="s3cret-for-metrics")
    post_update(client, bot, 7)
    return bot, InboundUpdate.objects.get(bot=bot, update_id=7)


def test_updates_received_are_counted_by_outcome_and_timed(client: Client, bot_factory) -> None:
    bot = bot_factory(webhook_secret="s3cret-for-metrics")
    timed = Moves("dovecote_webhook_duration_seconds_count")
    with (
        Moves("dovecote_updates_received_total", bot=bot.name, outcome="stored") as stored,
        Moves("dovecote_updates_received_total", bot=bot.name, outcome="duplicate") as duplicate,
        Moves("dovecote_updates_received_total", bot=bot.name, outcome="refused") as refused,
        Moves("dovecote_updates_received_total", bot="", outcome="refused") as unknown_bot,
        timed,
    ):
        assert post_update(client, bot, 1).status_code == 200
        assert post_update(client, bot, 1).status_code == 200
        assert client.post(bot.webhook_path, data="{}", content_type="application/json").status_code == 403
        assert client.post("/webhooks/telegram/nobody/", data="{}", content_type="application/json").status_code == 404

    assert (stored.by, duplicate.by, refused.by, unknown_bot.by) == (1, 1, 1, 1)
    assert timed.by == 4


@pytest.mark.django_db(transaction=True)  # the router's reply leaves after its commit
def test_a_consumer_run_is_counted_and_its_reply_counts_a_send_and_the_reply_latency(
    client: Client, bot_factory, sandbox
) -> None:
    bot, update = stored_update(client, bot_factory)

    with (
        Moves("dovecote_consumer_runs_total", consumer="auto_reply", outcome="done") as runs,
        Moves("dovecote_sends_total", bot=bot.name, method="sendMessage", outcome="ok") as sends,
        Moves("dovecote_bot_api_request_duration_seconds_count", method="sendMessage") as timed,
        Moves("dovecote_reply_latency_seconds_count") as latency,
    ):
        route(update)  # runs the echo here and sends its reply

    assert OutboundMessage.objects.get(source_update=update).state == State.SENT
    assert (runs.by, sends.by, timed.by, latency.by) == (1, 1, 1, 1)


@pytest.mark.hop_by_hop
def test_a_run_in_a_task_of_its_own_and_its_reply_sent_alone_are_counted_the_same(
    client: Client, bot_factory, sandbox
) -> None:
    bot, update = stored_update(client, bot_factory)
    inbox_update_route(update.pk)
    run = ConsumerRun.objects.get(update=update, consumer="auto_reply")

    with Moves("dovecote_consumer_runs_total", consumer="auto_reply", outcome="done") as runs:
        assert consumer_run_execute(run.pk) == "done"
    reply = OutboundMessage.objects.get(source_update=update)
    with (
        Moves("dovecote_sends_total", bot=bot.name, method="sendMessage", outcome="ok") as sends,
        Moves("dovecote_bot_api_request_duration_seconds_count", method="sendMessage") as timed,
        Moves("dovecote_reply_latency_seconds_count") as latency,
    ):
        assert outbound_message_send(reply.pk).status == "sent"

    assert (runs.by, sends.by, timed.by, latency.by) == (1, 1, 1, 1)


def test_a_temporary_provider_error_counts_a_transient_send_and_a_retry(bot, sandbox) -> None:
    message, _ = outbound_message_enqueue(bot_id=bot.pk, chat_id=5, payload={"text": "x"}, idempotency_key="t1")
    sandbox.fault("5xx", count=1)
    with (
        Moves("dovecote_sends_total", bot=bot.name, method="sendMessage", outcome="transient") as transient,
        Moves("dovecote_send_retries_total", reason="transient") as retries,
    ):
        outbound_message_send(message.pk)

    message.refresh_from_db()
    assert message.state == State.RETRY
    assert (transient.by, retries.by) == (1, 1)


def test_a_final_failure_counts_a_dead_letter_by_reason(bot, sandbox) -> None:
    with Moves("dovecote_dead_letters_total", kind="message", reason="permanent") as letters:
        failed_by_sandbox(sandbox, bot)
    assert letters.by == 1


def test_a_lost_answer_counts_an_ambiguous_send_and_an_opened_case(bot, sandbox) -> None:
    with (
        Moves("dovecote_reconciliation_cases_opened_total", kind="outbound_message") as cases,
        Moves("dovecote_sends_total", bot=bot.name, method="sendMessage", outcome="ambiguous") as ambiguous,
    ):
        lost_answer(bot, sandbox)
    assert (cases.by, ambiguous.by) == (1, 1)


def scraped(text: str, sample: str) -> float:
    """A sample's value in /metrics text, 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


LETTERS = 'dovecote_dead_letters_total{kind="consumer_run",reason="expired"}'
LETTERS_LABELS = {"kind": "consumer_run", "reason": "expired"}


def test_counts_of_another_process_reach_this_ones_metrics_through_redis_once(bot) -> None:
    """A worker on another dyno shares no directory with web: what it counts reaches /metrics
    through Redis. Here a separate Python process counts 2, forks a child that counts 1,
    and both exit: the total moves by 3 (the parent's unshipped 2 are not shipped twice)."""
    _, before = _scrape()
    program = textwrap.dedent(
        """
        import os, django
        django.setup()
        from core import metrics
        letters = metrics.DEAD_LETTERS.labels(kind="consumer_run", reason="expired")
        letters.inc(2)
        pid = os.fork()
        if pid == 0:
            letters.inc()
            metrics.ship()
            os._exit(0)
        os.waitpid(pid, 0)
        """
    )
    done = subprocess.run([sys.executable, "-c", program], env=base_env(), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()

    _, after = _scrape()
    assert scraped(after, LETTERS) - scraped(before, LETTERS) == 3


def test_a_forked_child_ships_under_its_own_sequence_and_the_parent_goes_on_with_its_own(bot) -> None:
    """A prefork child continues the parent's memory, shipment numbers included: unless it
    takes an identity of its own, the child's first shipment and the parent's next one carry
    the same number under the same name, and Redis keeps only one of them."""
    _, before = _scrape()
    program = textwrap.dedent(
        """
        import os, django
        django.setup()
        from core import metrics
        letters = metrics.DEAD_LETTERS.labels(kind="consumer_run", reason="expired")
        letters.inc(2)
        assert metrics.ship()
        pid = os.fork()
        if pid == 0:
            letters.inc()
            assert metrics.ship()
            os._exit(0)
        os.waitpid(pid, 0)
        letters.inc(4)
        assert metrics.ship()
        """
    )
    done = subprocess.run([sys.executable, "-c", program], env=base_env(), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()

    _, after = _scrape()
    assert scraped(after, LETTERS) - scraped(before, LETTERS) == 7


def test_a_process_sequence_entry_expires_and_the_process_still_ships_after(bot, monkeypatch) -> None:
    """Processes come and go: each one's last sequence is kept in Redis for a while only."""
    from core.connections import redis_client

    monkeypatch.setattr(metrics, "SEQUENCE_SECONDS", 1)
    metrics.DEAD_LETTERS.labels(kind="consumer_run", reason="expired").inc()
    assert metrics.ship() is True
    entry = metrics._sequence_key(metrics.SHIPPER.process)
    assert 0 < redis_client().pttl(entry) <= 1000
    before = _shared_total()

    wait_until(lambda: not redis_client().exists(entry), timeout=5, message="the sequence entry to expire")
    metrics.DEAD_LETTERS.labels(kind="consumer_run", reason="expired").inc()
    assert metrics.ship() is True

    assert _shared_total() - before == 1


def test_counts_made_while_redis_is_away_are_shipped_when_it_answers(bot) -> None:
    import redis

    _, before = _scrape()
    metrics.ship()
    # Redis away first: the process's own once-a-second shipper must not ship the count
    # before this test's call does.
    metrics.SHIPPER.client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens
    try:
        metrics.DEAD_LETTERS.labels(kind="consumer_run", reason="expired").inc()
        assert metrics.ship() is False
    finally:
        metrics.SHIPPER.client = None
    assert metrics.ship() is True

    _, after = _scrape()
    assert scraped(after, LETTERS) - scraped(before, LETTERS) == 1


class LostReplies:
    """A TCP proxy in front of the test's Redis: it forwards every request, and while
    `dropping` is set it throws Redis's replies away. Redis applies the write; the client
    waits past its socket timeout and takes the shipment for failed."""

    def __init__(self, redis_url: str) -> None:
        target = urlsplit(redis_url)
        self.target = (target.hostname or "127.0.0.1", target.port or 6379)
        self.db = target.path.lstrip("/") or "0"
        self.dropping = threading.Event()
        self.dropped = 0  # reply bytes thrown away
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/{self.db}"
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    return
                if replies and self.dropping.is_set():
                    self.dropped += len(data)
                    continue
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def lost_replies() -> Iterator[LostReplies]:
    from django.conf import settings

    proxy = LostReplies(settings.REDIS_URL)
    yield proxy
    metrics.SHIPPER.client = None
    proxy.close()


def _shared_total() -> float:
    """LETTERS's total in the shared hash, read straight from Redis (no shipment)."""
    from core.connections import redis_client

    field = metrics._field("dovecote_dead_letters", "dovecote_dead_letters_total", LETTERS_LABELS)
    return float(redis_client().hget(metrics._shared_key(), field) or 0)


def test_a_shipment_applied_by_redis_whose_reply_was_lost_counts_once(lost_replies: LostReplies) -> None:
    """Redis adds the shipment but its reply misses the client's timeout: the shipper keeps
    the counts and ships them again, and Redis must not add them twice (a false alert)."""
    from core.connections import redis_client

    metrics.SHIPPER.client = redis_client(lost_replies.url, timeout=0.5)
    # A first shipment through the proxy, with its replies: what Redis learns once (the
    # script) is learnt before the replies go missing.
    metrics.DEAD_LETTERS.labels(kind="message", reason="expired").inc()
    assert metrics.ship() is True
    before = _shared_total()

    lost_replies.dropping.set()
    metrics.DEAD_LETTERS.labels(kind="consumer_run", reason="expired").inc()
    assert metrics.ship() is False
    applied = _shared_total()
    lost_replies.dropping.clear()
    assert lost_replies.dropped > 0
    assert metrics.ship() is True  # the same shipment again, now with its reply

    metrics.SHIPPER.client = None
    _, text = _scrape()
    assert (applied - before, _shared_total() - before) == (1, 1)
    assert scraped(text, LETTERS) == _shared_total()


def _scrape() -> tuple[int, str]:
    with CaptureQueriesContext(connection) as queries:
        response = Client().get("/metrics", headers=METRICS_AUTH)
    assert response.status_code == 200
    return len(queries), response.content.decode()


def test_a_deleted_or_renamed_bots_counters_leave_metrics_after_a_sweep_and_the_others_stay(
    client: Client, bot_factory, sandbox
) -> None:
    """Counters of a bot that is gone (deleted), or gone from its old name (renamed), leave
    /metrics at the next sweep; those of the bots that are there, and the unknown-name
    refusals (bot=""), stay."""
    alice, bob, carol = bot_factory(), bot_factory(), bot_factory()
    for who in (alice, bob, carol):
        message, _ = outbound_message_enqueue(bot_id=who.pk, chat_id=5, payload={"text": "x"}, idempotency_key="p1")
        assert outbound_message_send(message.pk).status == "sent"
    assert client.post("/webhooks/telegram/nobody/", data="{}", content_type="application/json").status_code == 404
    bob_was, carol_was = bob.name, carol.name
    bob.name = f"{bob_was}-renamed"
    bob.save(update_fields=["name"])
    # A bot is deleted once its rows are (the outbox protects them): retention, then an operator.
    OutboundMessage.objects.filter(bot=carol).delete()
    carol.delete()
    _, before = _scrape()

    report = sweep()

    _, after = _scrape()
    sends = 'dovecote_sends_total{{bot="{}",method="sendMessage",outcome="ok"}}'
    assert (scraped(before, sends.format(bob_was)), scraped(before, sends.format(carol_was))) == (1, 1)
    assert f'bot="{bob_was}"' not in after
    assert f'bot="{carol_was}"' not in after
    assert scraped(after, sends.format(alice.name)) == 1
    assert scraped(after, 'dovecote_updates_received_total{bot="",outcome="refused"}') == 1
    # sends ok, transient of each: the two bots' started and counted series.
    assert report["metric_series_pruned"] == 4


def test_the_prune_leaves_the_series_when_redis_does_not_answer(bot) -> None:
    import redis

    metrics.SHIPPER.client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens
    try:
        assert metrics.prune_bots(lambda: {bot.name}) == 0
    finally:
        metrics.SHIPPER.client = None


def test_a_scrape_costs_seven_queries_whatever_the_number_of_bots(bot, sandbox) -> None:
    failed_by_sandbox(sandbox, bot)
    outbound_message_enqueue(bot_id=bot.pk, chat_id=9, payload={"text": "x"}, idempotency_key="w1")
    with_one_bot, _ = _scrape()
    for _ in range(9):
        other = make_bot(bot.api_base_url)
        outbound_message_enqueue(bot_id=other.pk, chat_id=9, payload={"text": "x"}, idempotency_key="w1")
    with_ten_bots, text = _scrape()

    assert with_one_bot == with_ten_bots == 7
    assert f'dovecote_bot_outbox_items{{bot="{bot.name}",state="pending"}} 1.0' in text
    assert 'dovecote_outbox_items{state="pending"} 10.0' in text
    assert 'dovecote_dead_letters_open_by_reason{reason="permanent"} 1.0' in text


def test_the_grafana_dashboard_is_importable_and_charts_only_exported_metrics(bot, sandbox) -> None:
    import json
    import re
    from pathlib import Path

    failed_by_sandbox(sandbox, bot)
    _, text = _scrape()
    exported = {re.sub(r"_total$", "", line.split()[2]) for line in text.splitlines() if line.startswith("# TYPE")}
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "deploy/grafana/dovecote.json").read_text())

    assert dashboard["__inputs"][0]["type"] == "datasource"
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dashboard["panels"])
    used = {
        re.sub(r"_(bucket|total)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"dovecote_\w+", target["expr"])
    }
    assert used - exported == set()
