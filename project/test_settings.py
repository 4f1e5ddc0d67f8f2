"""Settings for the test suite: real PostgreSQL and Redis on this machine.

Defaults only: DATABASE_URL / REDIS_URL from the environment still win. Each test run gets
its own test database and its own Redis key and queue prefixes (inherited by the workers it
starts), so two runs on one machine - a developer's and CI's - never consume each other's
tasks, and the fixtures that empty the run's keys never reach a deployment's.
"""

import os

os.environ.setdefault("DEBUG", "1")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/dovecote")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DOVECOTE_TEST_RUN_ID", str(os.getpid()))
# Never the environment's: tests/conftest.py deletes every key under the run's prefix, and a
# prefix exported for a deployment would name its live keys. The one queue prefix taken is one
# of the run's own: the RabbitMQ fixture's `test<run>-<n>.`, one test's queues, for its workers.
os.environ["DOVECOTE_REDIS_PREFIX"] = f"test{os.environ['DOVECOTE_TEST_RUN_ID']}:"
os.environ["DOVECOTE_QUEUE_PREFIX"] = (
    os.environ.get("DOVECOTE_QUEUE_PREFIX", "")
    if os.environ.get("DOVECOTE_QUEUE_PREFIX", "").startswith(f"test{os.environ['DOVECOTE_TEST_RUN_ID']}-")
    else f"test{os.environ['DOVECOTE_TEST_RUN_ID']}."
)
os.environ.setdefault("DOVECOTE_REPLY_DEBOUNCE_SECONDS", "0")
# Production's default: the router runs inline-safe consumers and a worker sends the replies it
# wrote. A test that drives each hop by hand says so (`hop_by_hop`, tests/conftest.py).
os.environ.setdefault("DOVECOTE_INLINE_WORK", "1")
os.environ.setdefault("TELEGRAM_API_BASE_URL", "http://127.0.0.1:9")
# /metrics is guarded as in production (tests run with DEBUG off): tests scrape with
# tests.support.METRICS_AUTH.
os.environ.setdefault("DOVECOTE_METRICS_TOKEN", "test-metrics-token")

from project.settings import *  # noqa: F403
from project.settings import DATABASES

DATABASES["default"].setdefault("TEST", {})["NAME"] = f"test_dovecote_{os.environ['DOVECOTE_TEST_RUN_ID']}"

# Tests that call a run in their own process read the rows it wrote in their own transaction,
# which an event loop's database threads cannot see: there, an awaiting consumer's run holds
# the caller as a synchronous one does. Tests of the event loop (tests/e2e/test_awaiting.py)
# give their workers a concurrency.
if "DOVECOTE_ASYNC_CONCURRENCY" not in os.environ:
    DOVECOTE_ASYNC_CONCURRENCY = 0

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# A test whose workers are killed mid-send gives them a send lease far shorter than a send may
# take, so that the sweeper notices them fast; it silences that check for them alone.
SILENCED_SYSTEM_CHECKS = [name for name in os.environ.get("DOVECOTE_TEST_SILENCED_CHECKS", "").split(",") if name]
