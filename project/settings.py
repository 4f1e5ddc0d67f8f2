"""Dovecote settings, read from the environment (12-factor; every variable is in docs/OPERATIONS.md).

DATABASE_URL (PostgreSQL) and REDIS_URL are always required: `make demo` starts its own
(scripts/demo.py). With DEBUG=1 every other variable has a development default; in production
(DEBUG off) SECRET_KEY and ALLOWED_HOSTS are required too.
"""

from collections.abc import Callable
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from core.connections import broker_kind, database_url_problem, redacted, redis_ssl_options, redis_url_problem
from project.sentry import init_sentry

BASE_DIR = Path(__file__).resolve().parent.parent


class _Env(environ.Env):
    """environ.Env whose value that cannot be read names its variable: `int("abc")` alone
    says neither which variable nor what it should be."""

    def get_value(self, var: str, cast=None, default=environ.Env.NOTSET, parse_default: bool = False):
        try:
            return super().get_value(var, cast=cast, default=default, parse_default=parse_default)
        except ValueError as exc:
            kind = {int: "an integer", float: "a number"}.get(cast, "valid")
            raise ImproperlyConfigured(f"{var}={self.ENVIRON.get(var, '')!r} is not {kind} ({exc}).") from None


env = _Env()

DEBUG = env.bool("DEBUG", default=False)


def _required_in_production(*names: str) -> None:
    """Fail closed: with DEBUG off, a missing variable stops the process at start with one
    line naming it, rather than falling back to a development default (an insecure key)."""
    missing = [name for name in names if not env.str(name, default="")]
    if missing:
        raise ImproperlyConfigured(
            f"{', '.join(missing)} must be set when DEBUG is off (DEBUG=1 has a development SECRET_KEY; "
            "`make demo` starts a PostgreSQL and a Redis of its own)."
        )


def _required_services() -> None:
    """Development too runs on PostgreSQL and Redis: without them, one line saying where to
    find a pair that needs no installing."""
    missing = [name for name in ("DATABASE_URL", "REDIS_URL") if not env.str(name, default="")]
    if missing:
        raise ImproperlyConfigured(
            f"{', '.join(missing)} must be set (`make demo` starts a PostgreSQL and a Redis of its own)."
        )


def _service_url(name: str, problem: Callable[[str], str], default: str = "") -> str:
    """A service's URL from the environment. One its clients cannot use (a typo, a bad port)
    stops the process at start with one line naming it, as a missing one does, rather than a
    parser's traceback or a first connection failing long after `check` passed."""
    url = env.str(name, default=default)
    wrong = problem(url) if url else ""
    if wrong:
        raise ImproperlyConfigured(f"{name}={redacted(url)!r}: {wrong}.")
    return url


if DEBUG:
    _required_services()
    SECRET_KEY = env.str("SECRET_KEY", default="dev-insecure-dovecote-key-change-me")
    ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]", "testserver"])
else:
    _required_in_production("SECRET_KEY", "DATABASE_URL", "REDIS_URL")
    SECRET_KEY = env.str("SECRET_KEY")
    ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=[])
    SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=True)
    CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=True)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_CONTENT_TYPE_NOSNIFF = True
    X_FRAME_OPTIONS = "DENY"
    # Off by default: health probes often come over plain HTTP from the load balancer, and
    # HSTS is hard to take back. Turn both on once TLS ends in front of every web process.
    SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=False)
    # The platform's health checks come over plain HTTP from inside: never redirected.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
    SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0)
    # Only with every subdomain on HTTPS, and to be listed in browsers' preload lists.
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False)
    SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)

CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    # django.contrib.admin, whose site checks every admin page's input first (project/admin_site.py).
    "project.admin_site.AdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served locally: no CDN
    "django_celery_beat",
    "outbox",
    "bots",
    "reconciliation",
]

MIDDLEWARE = [
    # Telegram's webhook skips the rest of the stack (bots/middleware.py): the hot path.
    "bots.middleware.webhook_first",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"

# --- Database -------------------------------------------------------------------------
# PostgreSQL only (postgres:// or postgresql://): the hot paths' statements are its own.
DATABASES = {"default": env.db_url_config(_service_url("DATABASE_URL", database_url_problem))}
# The same backend, with a health check that asks the socket before the server.
DATABASES["default"]["ENGINE"] = "project.postgresql"
# Persistent connections: a connection per request would cap the webhook's throughput
# (docs/PERFORMANCE.md).
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=600)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
    "connect_timeout", env.int("DATABASE_CONNECT_TIMEOUT", default=5)
)
# Prepared statements, for the hot paths' fixed statements only (core/rows.py: each
# asks for it, and is planned once per connection instead of on every run). Django's own
# statements are bound client-side, which psycopg never prepares; a threshold this high
# keeps psycopg from preparing anything else by count.
DATABASES["default"]["OPTIONS"].setdefault("prepare_threshold", 2**31 - 1)

# Behind PgBouncer in transaction pooling mode (Heroku's and most managed poolers), a client's
# consecutive transactions may run on different server connections, so nothing may rely on
# session state: no WITH HOLD cursors (Django's .iterator() outside a transaction), no
# server-side prepared statements (psycopg's prepare_threshold None: core/rows.py's
# statements then go unprepared, with their parameters still bound server-side in an unnamed
# statement, which PgBouncer passes), no server-side binding for Django's own statements.
# Dovecote itself takes no session locks (the sweeper uses a lease row) and there sets nothing
# per session (the plan_cache_mode of project/postgresql is for prepared statements only);
# Django's SET TIME ZONE is a parameter PgBouncer tracks per client.
DATABASE_POOLER = env.str("DATABASE_POOLER", default="")
if DATABASE_POOLER not in ("", "session", "transaction"):
    raise ImproperlyConfigured("DATABASE_POOLER must be empty, 'session' or 'transaction'.")
if DATABASE_POOLER == "transaction":
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    DATABASES["default"]["OPTIONS"]["prepare_threshold"] = None
    DATABASES["default"]["OPTIONS"].pop("server_side_binding", None)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}
WHITENOISE_USE_FINDERS = DEBUG

# --- Celery: at-least-once delivery, the database is the record ------------------------
REDIS_URL = _service_url("REDIS_URL", redis_url_problem)
# `rediss://` (Heroku Redis): how the server's certificate is checked, for every Redis client
# (broker, limiter, drain, sweeper, /readyz): none | optional | required. Heroku's is self-signed.
REDIS_SSL_CERT_REQS = env.str("REDIS_SSL_CERT_REQS", default="required").lower()
# Prefix of every Redis key Dovecote writes (broker queues, limiter, flood pauses), so that
# several deployments - or test runs - can share one Redis.
DOVECOTE_REDIS_PREFIX = env.str("DOVECOTE_REDIS_PREFIX", default="")
# Another broker (RabbitMQ: amqp://...) than REDIS_URL; Redis keeps the limiter, the drain's
# wake-up keys and the sweeper's. Celery itself also reads CELERY_BROKER_URL from the
# environment first, so this must agree with it.
_BROKER_URL = env.str("CELERY_BROKER_URL", default="") or env.str("DOVECOTE_BROKER_URL", default="")

CELERY_BROKER_URL = _BROKER_URL or REDIS_URL
CELERY_BROKER_TRANSPORT_OPTIONS = {}
if broker_kind(CELERY_BROKER_URL) == "redis":
    # Redis-only options (kombu's other transports ignore or refuse them).
    # Longer than any task (a send is bounded by the HTTP timeouts); long waits live
    # in the database as next_attempt_at, never as a Redis countdown past this.
    CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"] = env.int("CELERY_VISIBILITY_TIMEOUT", default=3600)
    if DOVECOTE_REDIS_PREFIX:
        CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] = DOVECOTE_REDIS_PREFIX
    CELERY_BROKER_USE_SSL = redis_ssl_options(CELERY_BROKER_URL, REDIS_SSL_CERT_REQS) or None

CELERY_TASK_ACKS_LATE = True
# Celery's Django fixup closes every database connection before and after each task unless
# this is set: a new PostgreSQL connection per task, the largest single cost of an outbox
# send. With it, the fixup closes them every 1,000 tasks, and
# project/celery.py applies Django's own CONN_MAX_AGE and health checks around each task.
CELERY_DB_REUSE_MAX = env.int("CELERY_DB_REUSE_MAX", default=1000)
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# A platform stops a dyno with SIGTERM and kills it 30 s later. Soft shutdown gives running
# tasks (a drain hands its worker back within 10 s) this long, then requeues the rest,
# countdown tasks included; a task still running at the kill is recovered by the sweeper.
CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT = env.float("CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT", default=15.0)
CELERY_WORKER_ENABLE_SOFT_SHUTDOWN_ON_IDLE = True
# Kept off on purpose: cancelling a task when the broker connection drops could stop a drain
# between a request and the record of its answer (an `unknown` for nothing). Left running,
# it records its outcomes; its redelivered message finds nothing to claim.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_TIMEZONE = "UTC"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Publishing from the webhook must fail fast when the broker is down: the row is committed and
# the sweeper dispatches it later, so a long publish retry would only delay the 200.
CELERY_BROKER_CONNECTION_TIMEOUT = env.float("CELERY_BROKER_CONNECTION_TIMEOUT", default=2.0)
CELERY_TASK_PUBLISH_RETRY = False
CELERY_TASK_DEFAULT_QUEUE = env.str("DOVECOTE_QUEUE_PREFIX", default="") + "dovecote"
CELERY_TASK_QUEUE_BULK = env.str("DOVECOTE_QUEUE_PREFIX", default="") + "dovecote.bulk"
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"

# --- Dovecote -------------------------------------------------------------------------
# /metrics requires `Authorization: Bearer <token>`; with DEBUG off and no token it answers 403.
DOVECOTE_METRICS_TOKEN = env.str("DOVECOTE_METRICS_TOKEN", default="")
# Hosts a bot's api_base_url may point to (with TELEGRAM_API_BASE_URL's): every request carries
# the bot's token. Loopback only in development by default: in production whatever else
# listens on the host would be handed the token; a local Bot API server is named explicitly.
DOVECOTE_BOT_API_HOSTS = env.list(
    "DOVECOTE_BOT_API_HOSTS",
    default=["api.telegram.org", "127.0.0.1", "localhost", "::1"] if DEBUG else ["api.telegram.org"],
)
TELEGRAM_API_BASE_URL = env.str("TELEGRAM_API_BASE_URL", default="https://api.telegram.org")
DOVECOTE_WEBHOOK_MAX_BYTES = env.int("DOVECOTE_WEBHOOK_MAX_BYTES", default=1_048_576)
DOVECOTE_REPLY_DEBOUNCE_SECONDS = env.float("DOVECOTE_REPLY_DEBOUNCE_SECONDS", default=0)
DOVECOTE_REPLY_DELAY_RANGE = env.list("DOVECOTE_REPLY_DELAY_RANGE", cast=float, default=[])
DOVECOTE_CRM_WEBHOOK_URL = env.str("DOVECOTE_CRM_WEBHOOK_URL", default="")
DOVECOTE_CRM_LOOKUP = env.str("DOVECOTE_CRM_LOOKUP", default="")
# Modules holding your consumers (dotted paths, comma-separated), imported at start-up beside
# every installed app's consumers.py: a consumer needs no app of its own in INSTALLED_APPS.
DOVECOTE_CONSUMER_MODULES = env.list("DOVECOTE_CONSUMER_MODULES", default=[])
DOVECOTE_CRM_TIMEOUT = env.float("DOVECOTE_CRM_TIMEOUT", default=10.0)
OPENAI_BASE_URL = env.str("OPENAI_BASE_URL", default="")
OPENAI_API_KEY = env.str("OPENAI_API_KEY", default="")
DOVECOTE_OPENAI_MODEL = env.str("DOVECOTE_OPENAI_MODEL", default="gpt-4o-mini")
DOVECOTE_OPENAI_TIMEOUT = env.float("DOVECOTE_OPENAI_TIMEOUT", default=30.0)
# Bot API HTTP timeouts (seconds). A read timeout means "maybe delivered".
DOVECOTE_TELEGRAM_CONNECT_TIMEOUT = env.float("DOVECOTE_TELEGRAM_CONNECT_TIMEOUT", default=5.0)
DOVECOTE_TELEGRAM_READ_TIMEOUT = env.float("DOVECOTE_TELEGRAM_READ_TIMEOUT", default=15.0)
# A worker's claim on a row; the sweeper treats rows past their lease as abandoned.
# Due messages of one bot sent per batch by the drain (outbox/sending/batch.py); 1 sends one per task.
DOVECOTE_DRAIN_BATCH_SIZE = env.int("DOVECOTE_DRAIN_BATCH_SIZE", default=8)
# Broadcast drains (the bulk lane, outbox/sending/batch.py) one host runs at once, whatever
# its workers' concurrency: the other worker processes stay free for routers and replies.
DOVECOTE_BULK_DRAINS_PER_HOST = env.int("DOVECOTE_BULK_DRAINS_PER_HOST", default=1)
# Inline work on the hot path: consumers declared inline-safe run in the router's task, and a
# consumer's replies are sent by its own worker right after the commit when the bot has room
# (the drain stays for backlogs, retries and pacing). Off: a task for every run and send.
DOVECOTE_INLINE_WORK = env.bool("DOVECOTE_INLINE_WORK", default=True)
# A bot's router, out of updates, waits this long with its wake-up key for the next one (a
# nudge through Redis) before it hands its worker back; it hands it back at once when other
# tasks wait in the broker's queues. 0: every update after a pause costs a publish and a hop.
DOVECOTE_ROUTER_LINGER_SECONDS = env.float("DOVECOTE_ROUTER_LINGER_SECONDS", default=1.0)
DOVECOTE_SEND_LEASE_SECONDS = env.int("DOVECOTE_SEND_LEASE_SECONDS", default=60)
# A consumer run's (and an effect's) claim: its live worker renews it every third of this
# (core/workers.py), so a dead worker's runs are taken over within it.
DOVECOTE_CONSUMER_LEASE_SECONDS = env.int("DOVECOTE_CONSUMER_LEASE_SECONDS", default=15)
# A consumer run is interrupted after this (Celery's soft time limit; a consumer's own `timeout`
# overrides it) and that counts as a failed attempt; a worker still stuck a grace later is ended.
DOVECOTE_CONSUMER_TIMEOUT_SECONDS = env.float("DOVECOTE_CONSUMER_TIMEOUT_SECONDS", default=240.0)
# Consumers that await (an `async def`, the openai responder, crm_webhook) run on one event
# loop per worker process (bots/aio.py): this many at once per process, their database steps
# through a pool of this many threads, each holding one PostgreSQL connection at most.
# 0: no event loop runs; each such run holds a Celery process for its whole wait, as a
# synchronous consumer's does.
DOVECOTE_ASYNC_CONCURRENCY = env.int("DOVECOTE_ASYNC_CONCURRENCY", default=256)
DOVECOTE_ASYNC_DB_CONNECTIONS = env.int("DOVECOTE_ASYNC_DB_CONNECTIONS", default=2)
DOVECOTE_OUTBOX_MAX_ATTEMPTS = env.int("DOVECOTE_OUTBOX_MAX_ATTEMPTS", default=8)
DOVECOTE_RETRY_BASE_SECONDS = env.float("DOVECOTE_RETRY_BASE_SECONDS", default=1.0)
DOVECOTE_RETRY_MAX_SECONDS = env.float("DOVECOTE_RETRY_MAX_SECONDS", default=300.0)
DOVECOTE_DEFAULT_RATE_LIMIT = env.int("DOVECOTE_DEFAULT_RATE_LIMIT", default=30)
DOVECOTE_PRIVATE_CHAT_RATE = env.str("DOVECOTE_PRIVATE_CHAT_RATE", default="1/second")
DOVECOTE_GROUP_CHAT_RATE = env.str("DOVECOTE_GROUP_CHAT_RATE", default="20/minute")
DOVECOTE_RATE_LIMITS_ENABLED = env.bool("DOVECOTE_RATE_LIMITS_ENABLED", default=True)
# Operators' bulk retries: the first batch, then twice as many each tick, capped by the rate limit.
DOVECOTE_BULK_TICK_SECONDS = env.float("DOVECOTE_BULK_TICK_SECONDS", default=1.0)
DOVECOTE_BULK_FIRST_BATCH = env.int("DOVECOTE_BULK_FIRST_BATCH", default=10)
DOVECOTE_RELEVANCE_CHECK = env.str("DOVECOTE_RELEVANCE_CHECK", default="")
DOVECOTE_PAYLOAD_RETENTION_DAYS = env.int("DOVECOTE_PAYLOAD_RETENTION_DAYS", default=30)
DOVECOTE_IDEMPOTENCY_KEEP_HOURS = env.int("DOVECOTE_IDEMPOTENCY_KEEP_HOURS", default=24)  # API keys: at least 24 h
# Sent and cancelled outbox messages (and their attempts) are deleted after this; 0 keeps them.
DOVECOTE_OUTBOX_RETENTION_DAYS = env.int("DOVECOTE_OUTBOX_RETENTION_DAYS", default=90)
DOVECOTE_LEDGER_RETENTION_DAYS = max(1, env.int("DOVECOTE_LEDGER_RETENTION_DAYS", default=7))
DOVECOTE_SWEEP_INTERVAL_SECONDS = env.int("DOVECOTE_SWEEP_INTERVAL_SECONDS", default=15)
# The sweeper's lease (reconciliation/sweeper.py), renewed after each step: longer than the
# longest step (retention stops after DOVECOTE_RETENTION_BUDGET_SECONDS); a killed sweeper
# holds the next one back at most this long.
DOVECOTE_SWEEP_LEASE_SECONDS = env.float("DOVECOTE_SWEEP_LEASE_SECONDS", default=60.0)
# on_ambiguous=resend: how long an unknown message waits before the sweeper resends it.
DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS = env.float("DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS", default=60.0)
# A row due this long ago and not claimed is taken to have lost its broker message.
DOVECOTE_REDISPATCH_GRACE_SECONDS = env.float("DOVECOTE_REDISPATCH_GRACE_SECONDS", default=30.0)
# A bot's circuit: first probe after it opens, the longest wait between failed probes (a probe
# is one getMe, so every few seconds: the first answer after an outage waits at most this
# long), and how long a probe holds the circuit before another may be sent (its worker may
# have died).
DOVECOTE_CIRCUIT_FIRST_PROBE_SECONDS = env.float("DOVECOTE_CIRCUIT_FIRST_PROBE_SECONDS", default=1.0)
DOVECOTE_CIRCUIT_MAX_PROBE_SECONDS = env.float("DOVECOTE_CIRCUIT_MAX_PROBE_SECONDS", default=2.0)
DOVECOTE_CIRCUIT_PROBE_LEASE_SECONDS = env.float("DOVECOTE_CIRCUIT_PROBE_LEASE_SECONDS", default=60.0)
# A retention pass (payload purges, pruning) runs at most this often once it has finished
# everything; while a backlog is left, every sweep continues it (reconciliation/retention.py).
DOVECOTE_RETENTION_INTERVAL_SECONDS = env.int("DOVECOTE_RETENTION_INTERVAL_SECONDS", default=3600)
# One pass stops after this many seconds (checked between batches) so a sweep never holds beat
# for long; each batch deletes or purges this many rows in its own transaction.
DOVECOTE_RETENTION_BUDGET_SECONDS = env.float("DOVECOTE_RETENTION_BUDGET_SECONDS", default=20.0)
DOVECOTE_RETENTION_BATCH_SIZE = env.int("DOVECOTE_RETENTION_BATCH_SIZE", default=2000)
# Failed and unknown messages, and updates whose runs failed, are deleted this long after
# their last change, and only once no dead letter or case of theirs is open; 0 keeps them.
DOVECOTE_FAILED_RETENTION_DAYS = env.int("DOVECOTE_FAILED_RETENTION_DAYS", default=180)
# A chat's reply guard is deleted after this long without an update (0 keeps them).
DOVECOTE_CHAT_STATE_RETENTION_DAYS = env.int("DOVECOTE_CHAT_STATE_RETENTION_DAYS", default=90)
# Decided reconciliation cases (and, while they are kept, their messages and effects); 0 keeps.
DOVECOTE_CASE_RETENTION_DAYS = env.int("DOVECOTE_CASE_RETENTION_DAYS", default=180)
# Operators' payload corrections hold text: by default they go with the payloads' retention.
DOVECOTE_PAYLOAD_VERSION_RETENTION_DAYS = env.int(
    "DOVECOTE_PAYLOAD_VERSION_RETENTION_DAYS", default=DOVECOTE_PAYLOAD_RETENTION_DAYS
)
DOVECOTE_BULK_RETRY_RETENTION_DAYS = env.int("DOVECOTE_BULK_RETRY_RETENTION_DAYS", default=90)
# The audit log is kept for ever unless this says otherwise.
# The ops digest (reconciliation/digest.py): a bot (by name) and a chat it sends to, e-mail
# addresses, extra channels (dotted paths of callables), and the throttle window.
DOVECOTE_OPS_BOT = env.str("DOVECOTE_OPS_BOT", default="")
DOVECOTE_OPS_CHAT_ID = env.str("DOVECOTE_OPS_CHAT_ID", default="")
DOVECOTE_OPS_EMAILS = env.list("DOVECOTE_OPS_EMAILS", default=[])
DOVECOTE_OPS_NOTIFIERS = env.list("DOVECOTE_OPS_NOTIFIERS", default=[])
DOVECOTE_OPS_DIGEST_MINUTES = env.int("DOVECOTE_OPS_DIGEST_MINUTES", default=5)
DOVECOTE_AUDIT_RETENTION_DAYS = env.int("DOVECOTE_AUDIT_RETENTION_DAYS", default=0)


# Numbers that would break what they name (a batch of no messages, a timeout of 0 s, a sweep
# every 0 s) stop every process at start with one line naming each, as a missing variable does.
_COUNTS = (  # at least 1
    "DOVECOTE_WEBHOOK_MAX_BYTES",
    "DOVECOTE_DRAIN_BATCH_SIZE",
    "DOVECOTE_BULK_DRAINS_PER_HOST",
    "DOVECOTE_OUTBOX_MAX_ATTEMPTS",
    "DOVECOTE_DEFAULT_RATE_LIMIT",
    "DOVECOTE_BULK_FIRST_BATCH",
    "DOVECOTE_SWEEP_INTERVAL_SECONDS",
    "DOVECOTE_RETENTION_BATCH_SIZE",
    "DOVECOTE_CONSUMER_LEASE_SECONDS",
    "DOVECOTE_ASYNC_DB_CONNECTIONS",
)
_DURATIONS = (  # above 0
    "DOVECOTE_TELEGRAM_CONNECT_TIMEOUT",
    "DOVECOTE_TELEGRAM_READ_TIMEOUT",
    "DOVECOTE_CRM_TIMEOUT",
    "DOVECOTE_OPENAI_TIMEOUT",
    "DOVECOTE_CONSUMER_TIMEOUT_SECONDS",
    "DOVECOTE_RETRY_MAX_SECONDS",
    "DOVECOTE_BULK_TICK_SECONDS",
    "DOVECOTE_SWEEP_LEASE_SECONDS",
    "DOVECOTE_CIRCUIT_FIRST_PROBE_SECONDS",
    "DOVECOTE_CIRCUIT_MAX_PROBE_SECONDS",
    "DOVECOTE_CIRCUIT_PROBE_LEASE_SECONDS",
)
_MAY_BE_ZERO = (  # at least 0: no wait, or for a retention what its 0 means (see each setting)
    "DOVECOTE_ASYNC_CONCURRENCY",
    "DOVECOTE_REPLY_DEBOUNCE_SECONDS",
    "DOVECOTE_RETRY_BASE_SECONDS",
    "DOVECOTE_AMBIGUOUS_RESEND_DELAY_SECONDS",
    "DOVECOTE_REDISPATCH_GRACE_SECONDS",
    "DOVECOTE_RETENTION_INTERVAL_SECONDS",
    "DOVECOTE_RETENTION_BUDGET_SECONDS",
    "DOVECOTE_PAYLOAD_RETENTION_DAYS",
    "DOVECOTE_IDEMPOTENCY_KEEP_HOURS",
    "DOVECOTE_OUTBOX_RETENTION_DAYS",
    "DOVECOTE_FAILED_RETENTION_DAYS",
    "DOVECOTE_CHAT_STATE_RETENTION_DAYS",
    "DOVECOTE_CASE_RETENTION_DAYS",
    "DOVECOTE_PAYLOAD_VERSION_RETENTION_DAYS",
    "DOVECOTE_BULK_RETRY_RETENTION_DAYS",
    "DOVECOTE_AUDIT_RETENTION_DAYS",
)
_RANGES = (
    (_COUNTS, "at least 1", lambda value: value >= 1),
    (_DURATIONS, "above 0", lambda value: value > 0),
    (_MAY_BE_ZERO, "at least 0", lambda value: value >= 0),
)
_out_of_range = [
    f"{name}={globals()[name]:g} ({words})"
    for names, words, holds in _RANGES
    for name in names
    if not holds(globals()[name])
]
if _out_of_range:
    raise ImproperlyConfigured(f"out of range: {', '.join(_out_of_range)}.")

# --- REST API ---------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Dovecote API",
    "DESCRIPTION": "Durable, idempotent Telegram Bot API outbox.",
    "VERSION": "1.0.0",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The schema and its docs follow the API's authentication (a token, or an admin session).
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
}

# --- Logging: JSON lines, secrets and message text masked --------------------------------
LOG_LEVEL = env.str("LOG_LEVEL", default="INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "mask": {"()": "core.logs.MaskSecretsFilter"},
        "trace": {"()": "core.logs.TraceIdFilter"},
    },
    "formatters": {
        "json": {
            "()": "core.logs.MaskingJsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s %(trace_id)s",
            "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
        },
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json",
            "filters": ["trace", "mask"],
        },
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        # httpx logs every request URL, and the URL carries the bot token.
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}

# --- Error reporting: Sentry when SENTRY_DSN is set, nothing otherwise (project/sentry.py) --
SENTRY_DSN = env.str("SENTRY_DSN", default="")
# sentry-sdk reads SENTRY_ENVIRONMENT and SENTRY_RELEASE from the environment itself.
SENTRY_ENABLED = init_sentry(SENTRY_DSN)
