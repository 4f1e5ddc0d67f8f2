"""Web, worker and beat behind a real PgBouncer in transaction pooling mode (what Heroku's
and most managed poolers run): consecutive transactions of one client land on different
server connections (`server_round_robin`, as a busy pooler does), so anything relying on
session state - a session advisory lock, a WITH HOLD cursor, a prepared statement - breaks.
The test's own assertions read the database directly."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.apps import apps as django_apps
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from outbox.models import OutboundMessage, State
from reconciliation.models import SweeperLease
from tests.reconciliation.factories import message_row
from tests.support import Process, free_port, require_tool, start_web, start_worker, wait_until

pytestmark = [pytest.mark.e2e]

PGBOUNCER = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)


@pytest.fixture
def pgbouncer(transactional_db: None, processes: list[Process]) -> Iterator[int]:
    """A pgbouncer in transaction mode on a free port in front of the test's PostgreSQL."""
    pgbouncer = require_tool("pgbouncer", PGBOUNCER, install="`make services` installs Debian's pgbouncer")
    db = connection.settings_dict
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="dovecote-pgbouncer-"))
    (tmp / "userlist.txt").write_text(f'"{db["USER"]}" ""\n')
    (tmp / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={db["HOST"]} port={db["PORT"] or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {tmp / "userlist.txt"}
pool_mode = transaction
server_round_robin = 1
default_pool_size = 6
min_pool_size = 3
max_client_conn = 200
ignore_startup_parameters = extra_float_digits,options
"""
    )
    os.chmod(tmp, 0o755)
    # PgBouncer refuses to run as root.
    user = ["-u", "nobody"] if os.geteuid() == 0 else []
    proc = Process("pgbouncer", [pgbouncer, *user, str(tmp / "pgbouncer.ini")], dict(os.environ))
    processes.append(proc)

    def up() -> bool:
        if not proc.alive():
            raise AssertionError(f"pgbouncer died on start:\n{proc.log()}")
        try:
            with psycopg.connect(host="127.0.0.1", port=port, user=db["USER"], dbname=db["NAME"]) as conn:
                return conn.execute("SELECT 1").fetchone()[0] == 1
        except psycopg.OperationalError:
            return False

    wait_until(up, timeout=10, interval=0.2, message="pgbouncer ready")
    yield port
    shutil.rmtree(tmp, ignore_errors=True)


def advisory_locks_here() -> int:
    """Advisory locks held in this test's database by any backend, the pooler's included."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
            " WHERE l.locktype = 'advisory' AND d.datname = current_database()"
        )
        return cursor.fetchone()[0]


def test_web_worker_and_beat_behind_a_transaction_pooling_pgbouncer_reply_once_and_sweep_one_at_a_time(
    pgbouncer: int, process_env: dict[str, str], processes: list[Process], sandbox, bot_factory
) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    db = connection.settings_dict
    env = {
        **process_env,
        "DATABASE_URL": f"postgres://{db['USER']}@127.0.0.1:{pgbouncer}/{db['NAME']}",
        "DATABASE_POOLER": "transaction",
    }
    # Transactional tests flush the tables: apply the data migration's schedule again, every second.
    importlib.import_module("reconciliation.migrations.0002_sweeper_schedule").schedule(django_apps, None)
    task = PeriodicTask.objects.get(task="reconciliation.sweep")
    task.interval = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    task.save()

    bot = bot_factory(webhook_secret="pooled-secret")
    web_proc, url = start_web(env, name="web-pgbouncer")
    processes.append(web_proc)
    worker = start_worker(env, concurrency=2, name="worker-pgbouncer")
    processes.append(worker)
    celery = os.path.join(os.path.dirname(sys.executable), "celery")
    scheduler = "django_celery_beat.schedulers:DatabaseScheduler"
    beat = Process("beat-pgbouncer", [celery, "-A", "project", "beat", "-l", "info", "--scheduler", scheduler], env)
    processes.append(beat)

    # An update through the webhook gets exactly one echo.
    call_command("set_webhook", bot.name, "--url", url)
    assert sandbox.push_message(bot.token, chat_id=7001, text="through the pooler")["webhook_status"] == 200
    wait_until(
        lambda: OutboundMessage.objects.filter(bot=bot, chat_id=7001, state=State.SENT).exists(),
        timeout=30,
        message=f"the echo reply\n{worker.log()}",
    )

    # A send left `sending` by a dead worker is recovered by beat's sweeper, and sent once.
    stuck = message_row(bot, key="pooled-stuck", state=State.SENDING, chat_id=7002)
    wait_until(
        lambda: OutboundMessage.objects.get(pk=stuck.pk).state == State.SENT,
        timeout=20,
        message=f"beat's sweeper to recover the stuck send\n{beat.log()}\n{worker.log()}",
    )
    assert sandbox.sent_texts(token=bot.token, chat_id=7001) == ["Echo: through the pooler"]
    assert sandbox.sent_texts(token=bot.token, chat_id=7002) == ["hello"]
    # A session advisory lock taken on one server connection and "released" on another
    # would be held here by an idle pooled connection, and later sweeps would skip.
    assert advisory_locks_here() == 0, worker.log()

    # Another sweeper (a second beat) holds the lease: beat's sweeps through the pooler step aside.
    SweeperLease.objects.update_or_create(
        pk=1, defaults={"holder": "other-beat:1:x", "expires_at": timezone.now() + timedelta(hours=1)}
    )
    skipped_before = worker.log().count("sweep skipped")
    second = message_row(bot, key="pooled-stuck-2", state=State.SENDING, chat_id=7003)
    wait_until(lambda: worker.log().count("sweep skipped") >= skipped_before + 2, timeout=10, message="two skips")
    assert OutboundMessage.objects.get(pk=second.pk).state == State.SENDING
    SweeperLease.objects.update(holder="", expires_at=None)  # the other one finishes
    wait_until(
        lambda: OutboundMessage.objects.get(pk=second.pk).state == State.SENT,
        timeout=15,
        message=f"the next sweep to run\n{worker.log()}",
    )

    # Nothing is left holding a lock on an idle pooled server connection.
    assert advisory_locks_here() == 0
    assert OutboundMessage.objects.filter(bot=bot, state=State.SENT).count() == 3
