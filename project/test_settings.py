"""Settings for the test suite: real PostgreSQL and Redis on this machine.

Defaults only: DATABASE_URL / REDIS_URL from the environment still win.
"""

import os

os.environ.setdefault("DEBUG", "1")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/dovecote")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DOVECOTE_QUEUE_PREFIX", "test.")
os.environ.setdefault("DOVECOTE_REPLY_DEBOUNCE_SECONDS", "0")
os.environ.setdefault("TELEGRAM_API_BASE_URL", "http://127.0.0.1:9")

from project.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
