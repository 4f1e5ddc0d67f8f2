"""The bare Django peer of bench/sidebyside.py: parse the update's JSON, one
`INSERT … ON CONFLICT DO NOTHING` into one table, answer 200. No secret check, no
middleware, no logging, no broker: the floor under any Django webhook that stores updates.

    BARE_DATABASE_URL=postgres://postgres@127.0.0.1:5432/DB BIND=127.0.0.1:8100 \\
        .venv/bin/gunicorn -c bench/peers/bare_gunicorn.conf.py bench.peers.bare_view:application

bench/sidebyside.py creates the database and its one table, `bare_update` (update_id bigint
primary key, payload jsonb, received_at timestamptz).
"""

from __future__ import annotations

import json
import os

import environ
from django.conf import settings

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="bench-bare-view-not-secret",
        ALLOWED_HOSTS=["127.0.0.1", "localhost"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=[],
        INSTALLED_APPS=[],
        USE_TZ=True,
        # Persistent connections, as Dovecote's web process keeps them.
        DATABASES={"default": {**environ.Env.db_url_config(os.environ["BARE_DATABASE_URL"]), "CONN_MAX_AGE": 600}},
    )

import django

django.setup()

from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.db import connection  # noqa: E402
from django.http import HttpRequest, HttpResponse, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402


def webhook(request: HttpRequest, rest: str = "") -> HttpResponse:
    if request.method != "POST":
        return HttpResponse("ok")  # readiness probe
    try:
        payload = json.loads(request.body)
        update_id = int(payload["update_id"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"ok": False}, status=400)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO bare_update (update_id, payload) VALUES (%s, %s::jsonb) ON CONFLICT DO NOTHING",
            [update_id, request.body.decode()],
        )
    return JsonResponse({"ok": True})


urlpatterns = [path("", webhook), path("<path:rest>", webhook)]

application = get_wsgi_application()
