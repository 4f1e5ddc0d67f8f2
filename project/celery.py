"""The Celery application. Configuration lives in Django settings under CELERY_*."""

from typing import Any

from celery import Celery
from celery.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
)

from project.failclosed import load_settings_or_exit, refuse_to_start_worker
from project.heap import tune_garbage_collector

load_settings_or_exit()

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# Dovecote's system checks, which `manage.py check` and `migrate` enforce, stop a worker too.
worker_init.connect(refuse_to_start_worker, dispatch_uid="project.refuse_to_start_worker")


@task_prerun.connect(dispatch_uid="project.close_old_connections_before_task")
@task_postrun.connect(dispatch_uid="project.close_old_connections_after_task")
def close_old_connections(**kwargs: Any) -> None:
    """What Django does around a request: drop connections past CONN_MAX_AGE or broken
    (health checks), keep the rest. Celery's fixup would otherwise close them all around
    every task (settings.CELERY_DB_REUSE_MAX)."""
    if getattr(kwargs.get("task"), "request", None) is not None and kwargs["task"].request.is_eager:
        return
    from django.db import close_old_connections as django_close_old_connections

    django_close_old_connections()


@worker_ready.connect(dispatch_uid="project.tune_gc_when_ready")
@worker_process_init.connect(dispatch_uid="project.tune_gc_in_child")
def tune_gc(**kwargs: Any) -> None:
    """The worker's startup heap out of the garbage collector's passes, and its youngest
    generation collected less often (project/heap.py): in each prefork child once it is set
    up, and in the main process once it is ready (the solo and threads pools run their tasks
    there)."""
    tune_garbage_collector()


@worker_ready.connect(dispatch_uid="project.watch_outages_when_ready")
@worker_process_init.connect(dispatch_uid="project.watch_outages_in_child")
def watch_outages(**kwargs: Any) -> None:
    """A worker process resumes the work an outage of PostgreSQL or Redis cut off as soon as
    both answer again (core/workers.py OutageWatch, reconciliation/resume.py), and once
    as it starts."""
    from core.workers import outage_watch

    outage_watch.start(watch_redis=True)
    # A worker that starts (after a crash, a deploy) does not know what its predecessor's
    # end lost in the broker (a probe's timer, a drain's wake-up): it hands on what waits
    # in the rows once, as after an outage (one process of all does it).
    outage_watch.note("this worker started")


@task_failure.connect(dispatch_uid="project.note_outage")
def note_outage(exception: BaseException | None = None, **kwargs: Any) -> None:
    """A task that failed because PostgreSQL or Redis went away: its claims are taken up
    again, by this process, once they are back."""
    import redis
    from django.db import InterfaceError, OperationalError
    from kombu.exceptions import OperationalError as BrokerError

    if isinstance(exception, OperationalError | InterfaceError | redis.RedisError | BrokerError):
        from core.workers import outage_watch

        outage_watch.note(f"{type(exception).__name__} in a task")


@worker_process_shutdown.connect(dispatch_uid="project.metrics_ship")
def metrics_ship(**kwargs: Any) -> None:
    """A prefork child exits (without running atexit): ship its last second of counts."""
    from core.metrics import ship

    ship()


def _survive_a_lost_redis() -> None:
    """kombu 5.7's Redis transport, after the broker connection was lost, still uses the
    channel it closed, whose connection is already gone, and the worker dies of the
    AttributeError instead of reconnecting (seen with a Redis restart:
    tests/e2e/test_fault_schedules.py, tests/e2e/test_redis_restart.py):

    - closing the channel, it restores the worker's unacknowledged messages through it
      (`'NoneType' object has no attribute 'hostname'`);
    - a task that finishes after the loss (acks_late) is acknowledged, or rejected, on it
      (`... no attribute 'client'`).

    Both are skipped instead: the messages stay in Redis's unacked set and come back after
    the visibility timeout (a task run again finds its rows done), and if Redis lost them,
    the sweeper redispatches their rows."""
    import logging

    import redis
    from kombu.transport import redis as kombu_redis

    qos = kombu_redis.QoS
    restore, ack, reject = qos.restore_unacked, qos.ack, qos.reject
    logger = logging.getLogger(__name__)

    def restore_unacked(self: Any, client: Any = None) -> Any:
        try:
            return restore(self, client)
        except (AttributeError, redis.RedisError) as exc:
            unacked = len(self._delivered)
            logger.warning("broker connection lost: %d unacknowledged message(s) left to redelivery (%r)", unacked, exc)
            self._delivered.clear()
            return None

    def unless_closed(settle: Any) -> Any:
        def settle_unless_closed(self: Any, delivery_tag: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return settle(self, delivery_tag, *args, **kwargs)
            except AttributeError:
                if self.channel.connection is not None:  # not the channel closed with the connection
                    raise
                logger.warning("message %s came through a lost broker connection: left to redelivery", delivery_tag)
                return None

        return settle_unless_closed

    qos.restore_unacked = restore_unacked
    qos.ack = unless_closed(ack)
    qos.reject = unless_closed(reject)


_survive_a_lost_redis()
