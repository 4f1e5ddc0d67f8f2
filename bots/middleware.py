"""Telegram's webhook ahead of the middleware stack.

The stack (sessions, authentication, CSRF, messages, static files, clickjacking headers)
serves the admin and the dashboards; none of it means anything to the Bot API's POST of an
update, and on the hot path it costs as much CPU as the update's INSERT. So this middleware,
first in MIDDLEWARE, hands a webhook request straight to its view. What the stack would do
for it otherwise: a plain-HTTP request under SECURE_SSL_REDIRECT and a path that does not
match the webhook's route (a missing slash, an unknown route) still go through the stack.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from bots.views import telegram_webhook

# bots/urls.py's "webhooks/telegram/<str:name>/" (a str converter is [^/]+), matched here
# without the URL resolver's walk of every pattern (tests/bots/test_webhook.py checks that
# the two agree).
WEBHOOK_PATH = re.compile(r"/webhooks/telegram/(?P<name>[^/]+)/")


def webhook_first(get_response: Callable[[HttpRequest], HttpResponse]) -> Callable[[HttpRequest], HttpResponse]:
    def middleware(request: HttpRequest) -> HttpResponse:
        match = WEBHOOK_PATH.fullmatch(request.path_info)
        if match is not None and (not settings.SECURE_SSL_REDIRECT or request.is_secure()):
            return telegram_webhook(request, match["name"])
        return get_response(request)

    return middleware
