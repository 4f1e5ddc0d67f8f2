"""Telegram's webhook ahead of the middleware stack.

The stack (sessions, authentication, CSRF, messages, static files, clickjacking headers)
serves the admin and the dashboards; none of it means anything to the Bot API's POST of an
update, and on the hot path it costs as much CPU as the update's INSERT. So this middleware,
first in MIDDLEWARE, hands a webhook request straight to its view. What the stack would do
for it otherwise: a plain-HTTP request under SECURE_SSL_REDIRECT and a path that does not
resolve (a missing slash, an unknown route) still go through the stack as before.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import Resolver404, resolve

from bots.views import telegram_webhook

WEBHOOK_PREFIX = "/webhooks/telegram/"


def webhook_first(get_response: Callable[[HttpRequest], HttpResponse]) -> Callable[[HttpRequest], HttpResponse]:
    def middleware(request: HttpRequest) -> HttpResponse:
        if request.path_info.startswith(WEBHOOK_PREFIX) and (not settings.SECURE_SSL_REDIRECT or request.is_secure()):
            try:
                match = resolve(request.path_info)
            except Resolver404:
                return get_response(request)
            if match.func is telegram_webhook:
                return telegram_webhook(request, *match.args, **match.kwargs)
        return get_response(request)

    return middleware
