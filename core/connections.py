"""Connections to the services named in settings: every Redis client Dovecote opens (TLS
aware, one setting for `rediss://`) and the checks behind /readyz.

Pure functions of a URL where settings.py needs them (it cannot import Django's settings).
"""

from __future__ import annotations

import ssl
from collections.abc import Collection
from functools import cache
from typing import Any
from urllib.parse import SplitResult, urlsplit

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
REDIS_SCHEMES = ("redis", "rediss")
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
# django-environ's names for PostgreSQL: the only database Dovecote runs on.
POSTGRES_SCHEMES = ("postgres", "postgresql", "pgsql")


def broker_kind(url: str) -> str:
    """`redis`, `amqp` or the URL's own scheme."""
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in REDIS_SCHEMES:
        return "redis"
    if scheme in AMQP_SCHEMES:
        return "amqp"
    return scheme


def redacted(url: str) -> str:
    """The URL with its password as `***`: a message about a bad URL names it, not its secret."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{hosts}").geturl()


def _port_problem(parts: SplitResult) -> str:
    # Each host of the netloc (libpq takes several, comma-separated); an IPv6 host is bracketed.
    for host in parts.netloc.rpartition("@")[2].split(","):
        _, colon, port = host.rpartition("]")[2].rpartition(":")
        if colon and not (port.isdigit() and 1 <= int(port) <= 65535):
            return f"port {port!r} is not a number from 1 to 65535"
    return ""


def database_url_problem(url: str, schemes: Collection[str] = POSTGRES_SCHEMES) -> str:
    """What makes a DATABASE_URL unusable, in a few words; "" when nothing does. Asked before
    django-environ parses it: its parser answers a URL without a scheme with a KeyError and a
    bad port with a bare ValueError, and takes an unknown scheme for a backend's name that
    Django fails to import at the first query."""
    parts = urlsplit(url)
    if not parts.scheme:
        return "not a URL (postgres://user:password@host:5432/name)"
    if parts.scheme.lower() not in schemes:
        return f"unknown database scheme {parts.scheme!r} (postgres://)"
    if not parts.path.strip("/"):
        return "names no database (postgres://user:password@host:5432/name)"
    return _port_problem(parts)


def redis_url_problem(url: str) -> str:
    """What makes a REDIS_URL unusable, in a few words; "" when nothing does. Without this,
    `check` passed and every Redis client failed at its first connection, a worker logging a
    traceback per attempt."""
    parts = urlsplit(url)
    if not parts.scheme:
        return "not a URL (redis://host:6379/0)"
    if parts.scheme.lower() not in REDIS_SCHEMES:
        return f"the scheme must be redis:// or rediss://, not {parts.scheme}://"
    if not parts.hostname:
        return "no host (redis://host:6379/0)"
    database = parts.path.strip("/")
    if database and not database.isdigit():
        return f"database number {database!r} is not an integer"
    return _port_problem(parts)


def redis_ssl_options(url: str, cert_reqs: str) -> dict[str, Any]:
    """redis-py's (and kombu's `broker_use_ssl`) options for a `rediss://` URL, {} otherwise.
    Without them kombu silently skips verification of a rediss broker, while redis-py verifies."""
    if not url.lower().startswith("rediss://"):
        return {}
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"REDIS_SSL_CERT_REQS must be one of {', '.join(CERT_REQS)}, not {cert_reqs!r}")
    return {"ssl_cert_reqs": CERT_REQS[cert_reqs]}


def redis_client(url: str | None = None, *, timeout: float = 2.0) -> Any:
    """A client for Dovecote's own Redis (REDIS_URL unless given), with REDIS_SSL_CERT_REQS."""
    import redis
    from django.conf import settings

    url = url or settings.REDIS_URL
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        **redis_ssl_options(url, settings.REDIS_SSL_CERT_REQS),
    )


@cache
def shared_redis() -> Any:
    """This process's one client for Dovecote's own Redis keys (the limiter's, the wake-ups',
    the sweeper's), made on first use."""
    return redis_client()


def check_redis(url: str | None = None, *, timeout: float = 1.0) -> tuple[bool, str]:
    import redis

    try:
        redis_client(url, timeout=timeout).ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return True, "ok"


def check_database() -> tuple[bool, str]:
    """Whether PostgreSQL answers a query now, through Django's connection (opened if need
    be); (ok, "ok" or the error's type). A connection that failed is closed, so the next use
    opens a new one."""
    from django.db import DatabaseError, connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        connection.close()
        return False, type(exc).__name__
    return True, "ok"


def check_broker(*, timeout: float = 1.0) -> tuple[bool, str]:
    """Whether the broker that Celery is configured with (settings.CELERY_BROKER_URL) takes
    a connection now; (ok, kind or the error)."""
    from django.conf import settings

    url = settings.CELERY_BROKER_URL
    kind = broker_kind(url)
    if kind == "redis":
        ok, detail = check_redis(url, timeout=timeout)
        return ok, "redis" if ok else detail
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=timeout, ssl=getattr(settings, "CELERY_BROKER_USE_SSL", None)) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - any transport's error means "not reachable"
        return False, f"{type(exc).__name__}: {exc}"
    return True, kind
