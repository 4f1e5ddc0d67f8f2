"""Redis restarting while a worker runs a task: the worker reconnects and goes on. Found by
seed 1 of tests/e2e/test_fault_schedules.py: the task finished after the broker connection
was lost, its late acknowledgement went to the channel the reconnect had closed, kombu's
Redis transport raised AttributeError there, and Celery stopped the whole worker on it
(sending and routing stalled until a new worker started and the sweeper came round)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox.models import OutboundMessage, State
from outbox.services import outbound_message_enqueue
from tests.e2e import chaos
from tests.support import PrivateRedis, Process, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

SLOW = 3.0  # the first send's answer: Redis restarts while the worker waits for it


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()


def test_a_worker_goes_on_after_redis_restarts_under_a_running_task(
    process_env: dict[str, str], processes: list[Process], private_redis: PrivateRedis, sandbox, bot_factory
) -> None:
    bot = bot_factory()
    sandbox.fault("slow", method="sendMessage", delay=SLOW, count=1)
    env = {**process_env, "REDIS_URL": private_redis.url, "DOVECOTE_TELEGRAM_READ_TIMEOUT": str(SLOW + 5)}
    with chaos.broker_at(private_redis.url):
        # Two processes: with one task running the consumer still waits on Redis for another
        # (BRPOP), so the reconnect's first close of its channel fails and the connection is
        # torn down before the channel is closed, the order seed 1 met.
        worker = start_worker(env, concurrency=2)
        processes.append(worker)

        def enqueue(n: int) -> OutboundMessage:
            message, _ = outbound_message_enqueue(
                bot_id=bot.pk, chat_id=40 + n, payload={"text": f"message {n}"}, idempotency_key=f"restart-{n}"
            )
            return message

        def sent(message: OutboundMessage) -> bool:
            return OutboundMessage.objects.get(pk=message.pk).state == State.SENT

        first = enqueue(1)
        wait_until(lambda: sandbox.calls(token=bot.token, method="sendMessage"), message="the first send in flight")
        private_redis.kill()
        private_redis.start()

        wait_until(lambda: sent(first), timeout=SLOW + 10, message="the first send finishing")
        # Its task returns and is acknowledged (on the channel the reconnect closed).
        wait_until(lambda: "succeeded in" in worker.log(), timeout=10, message="the first task returning")
        second = enqueue(2)
        wait_until(lambda: sent(second) or not worker.alive(), timeout=20, message="the second send")
        assert worker.alive(), worker.log()[-3000:]
        assert sent(second)
        assert "Unrecoverable error" not in worker.log()
