"""A worker that loses PostgreSQL in the middle of a run takes that run up again itself as
soon as PostgreSQL is back (reconciliation/resume.py), with no sweeper running: before, the
run stayed `running` until its lease ran out and the sweeper's next tick found it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection

from bots import inbox, routing
from bots.models import ConsumerRun, RunState
from tests.conftest import make_bot
from tests.private_postgres import PrivatePostgres
from tests.support import HeldEndpoint, Process, start_worker, wait_until
from tests.test_rows import crashable_db, crashable_postgres  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture
def crm() -> Iterator[HeldEndpoint]:
    server = HeldEndpoint()
    server.hold.set()
    yield server
    server.close()


@pytest.mark.django_db(transaction=True)
def test_a_run_cut_off_by_a_postgresql_crash_is_run_again_by_its_worker_once_postgresql_is_back(
    crashable_db: PrivatePostgres,  # noqa: F811 - the fixture imported above
    process_env: dict[str, str],
    processes: list[Process],
    sandbox_server,
    crm: HeldEndpoint,
) -> None:
    env = {
        **process_env,
        "DATABASE_URL": crashable_db.url(connection.settings_dict["NAME"]),
        "DOVECOTE_CRM_WEBHOOK_URL": crm.url,
    }
    processes.append(start_worker(env, concurrency=2))  # no beat: no sweeper will come
    bot = make_bot(sandbox_server.base_url)
    user = {"id": 42, "is_bot": False, "first_name": "Ada"}
    message = {"message_id": 1, "from": user, "chat": {**user, "type": "private"}, "date": 1, "text": "a lead"}
    payload = {"update_id": 1, "message": message}
    inbox.inbox_update_receive(bot=bot, payload=payload, body=None, trace_id="resume-test")
    routing.inbox_router_wake(bot.pk)

    wait_until(lambda: crm.posts, timeout=60, message="the CRM run to start")
    crashable_db.crash()  # the run is `running`, its POST out
    crm.release.set()  # the answer comes; the worker cannot write it down
    connection.close()
    crashable_db.start()

    def crm_run() -> ConsumerRun | None:
        connection.close()  # the test's own connection died with the crash
        try:
            return ConsumerRun.objects.filter(consumer="crm_webhook").first()
        except Exception:  # PostgreSQL still recovering
            return None

    run = wait_until(lambda: (r := crm_run()) is not None and r.state == RunState.DONE and r, timeout=60)
    assert run.attempts == 2
    assert len(crm.posts) == 2
    assert len({key for key, _ in crm.posts}) == 1  # sent again with the same key
