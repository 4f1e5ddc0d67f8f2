"""The webhook: verify, store, acknowledge."""

from __future__ import annotations

import hmac
import json
import logging
import time
from functools import partial
from typing import Any

from django.conf import settings
from django.db import DatabaseError, DataError, InterfaceError, OperationalError, connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from bots.inbox import inbox_update_receive, new_trace_id, webhook_bot
from bots.models import Bot
from core import metrics
from core.logs import current_trace_id
from core.payloads import MAX_JSON_DEPTH, json_depth

logger = logging.getLogger(__name__)


# The answer to every stored or duplicate update, encoded once.
_OK = json.dumps({"ok": True}).encode()


def _error(status: int, description: str) -> JsonResponse:
    return JsonResponse({"ok": False, "error": description}, status=status)


@csrf_exempt
def telegram_webhook(request: HttpRequest, name: str) -> HttpResponse:
    # The trace id lives for this request only: a server thread's next request must not
    # log under it.
    token = current_trace_id.set("")
    started = time.monotonic()
    try:
        response = _receive(request, name)
    finally:
        current_trace_id.reset(token)
    metrics.WEBHOOK_SECONDS.observe(time.monotonic() - started)
    if response.status_code == 200:
        outcome = "stored" if getattr(request, "dovecote_stored", False) else "duplicate"
    else:
        outcome = "unavailable" if response.status_code >= 500 else "refused"
    # Only a known bot's name is a label: a scanner's made-up names must not make new series.
    metrics.UPDATES.labels(bot=getattr(request, "dovecote_bot", ""), outcome=outcome).inc()
    return response


def _receive(request: HttpRequest, name: str) -> HttpResponse:
    if request.method != "POST":
        response = _error(405, "method not allowed; Telegram POSTs updates")
        response["Allow"] = "POST"
        return response
    # The size check comes before reading or parsing the body.
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return _error(400, "invalid Content-Length")
    if length > settings.DOVECOTE_WEBHOOK_MAX_BYTES:
        return _error(413, f"body over {settings.DOVECOTE_WEBHOOK_MAX_BYTES} bytes")

    trace_id = new_trace_id()
    current_trace_id.set(trace_id)
    try:
        bot = webhook_bot(name)
        if bot is None:
            return _error(404, "unknown or inactive bot")
        request.dovecote_bot = bot.name  # type: ignore[attr-defined]
        if bot.webhook_secret:
            # META, not request.headers: that builds a dict of every header per request.
            given = request.META.get("HTTP_X_TELEGRAM_BOT_API_SECRET_TOKEN", "")
            if not hmac.compare_digest(given.encode(), bot.webhook_secret.encode()):
                return _error(403, "missing or wrong secret token")
        elif not settings.DEBUG:
            # Anyone who knows the bot's name could post updates: refuse until it has a secret.
            return _error(403, "this bot has no webhook secret; set one with add_bot")

        body = request.read(settings.DOVECOTE_WEBHOOK_MAX_BYTES + 1)
        if len(body) > settings.DOVECOTE_WEBHOOK_MAX_BYTES:
            return _error(413, f"body over {settings.DOVECOTE_WEBHOOK_MAX_BYTES} bytes")
        try:
            payload = json.loads(body)
        except RecursionError:
            # json's decoder gives up around a thousand levels.
            return _error(400, f"body nested deeper than {MAX_JSON_DEPTH} levels")
        except (ValueError, UnicodeDecodeError):
            return _error(400, "body is not JSON")
        if not isinstance(payload, dict):
            return _error(400, "body is not a JSON object")
        # Parsed but deeper than any Update: refused here, so every stored payload can be
        # walked, serialised and shown without running out of stack. No deeper than its
        # count of opening brackets (those in strings too), which spares most bodies the walk.
        brackets = body.count(b"{") + body.count(b"[")
        if brackets > MAX_JSON_DEPTH and json_depth(payload, stop_above=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            return _error(400, f"body nested deeper than {MAX_JSON_DEPTH} levels")
        update_id = payload.get("update_id")
        if isinstance(update_id, bool) or not isinstance(update_id, int) or not -(2**63) <= update_id < 2**63:
            return _error(400, "update_id must be an integer")

        try:
            created, update_type = _store(bot, payload, _as_text(body), trace_id)
        except DataError:
            # E.g. a \u0000 inside a string, which PostgreSQL's jsonb refuses: bad input,
            # and retrying would not help.
            return _error(400, "the update cannot be stored as JSON")
    except DatabaseError:
        # Telegram retries a non-2xx answer; never 200 for an update that is not stored.
        logger.exception("database unavailable; answered 503")
        return _error(503, "storage unavailable, retry later")
    request.dovecote_stored = created  # type: ignore[attr-defined]
    # A stored update's INFO line is the router's ("update N routed to ...", same trace id):
    # one line per update, not two. A duplicate (Telegram retried) is worth one here.
    logger.log(
        logging.DEBUG if created else logging.INFO,
        "update %s %s",
        update_id,
        "stored" if created else "duplicate dropped",
        extra={"bot": bot.name, "update_type": update_type},
    )
    return HttpResponse(_OK, content_type="application/json")


def _as_text(body: bytes) -> str | None:
    """The body as the JSON text to store, when it is UTF-8 without a byte order mark (as
    Telegram sends it); otherwise None, and the parsed payload is encoded again."""
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return None  # json.loads also reads UTF-16 and UTF-32
    return None if text.startswith("\ufeff") else text


def _store(bot: Bot, payload: dict[str, Any], body: str | None, trace_id: str) -> tuple[bool, str]:
    """The update's one statement, committed by itself (autocommit): no BEGIN and COMMIT
    round trips, and the 200 still comes only after the commit. Inside a transaction already
    (ATOMIC_REQUESTS), a savepoint keeps it usable after a refused row.

    The connection's health check is skipped: the INSERT tells the same (and, unlike the
    check's look at the socket, project/postgresql, also a close that has not reached it
    yet), and costs no system call on the hot path. A reused connection that turns out dead (PostgreSQL restarted) is
    replaced and the INSERT sent once more: it is idempotent (ON CONFLICT DO NOTHING)."""
    store = partial(inbox_update_receive, bot=bot, payload=payload, body=body, trace_id=trace_id)
    if connection.in_atomic_block:
        with transaction.atomic():
            return store()
    reused = connection.connection is not None
    connection.health_check_done = True
    try:
        return store()
    except (OperationalError, InterfaceError):
        if not reused:
            raise
        logger.warning("the database connection was lost; storing the update on a new one")
        connection.close()
        return store()
