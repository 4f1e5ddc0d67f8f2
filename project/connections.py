"""Connections to the services named in settings: every Redis client Dovecote opens (TLS
aware, one setting for `rediss://`) and the broker check behind /readyz.

Pure functions of a URL where settings.py needs them (it cannot import Django's settings).
"""

from __future__ import annotations

import ssl
from typing import Any

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
REDIS_SCHEMES = ("redis", "rediss")
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")


def broker_kind(url: str) -> str:
    """`redis`, `amqp` or the URL's own scheme (`filesystem`, ...)."""
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in REDIS_SCHEMES:
        return "redis"
    if scheme in AMQP_SCHEMES:
        return "amqp"
    return scheme


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


def check_redis(url: str | None = None, *, timeout: float = 1.0) -> tuple[bool, str]:
    import redis

    try:
        redis_client(url, timeout=timeout).ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
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
    if kind == "filesystem":
        return settings.BROKER_DIR.is_dir(), "filesystem"
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=timeout, ssl=getattr(settings, "CELERY_BROKER_USE_SSL", None)) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - any transport's error means "not reachable"
        return False, f"{type(exc).__name__}: {exc}"
    return True, kind
