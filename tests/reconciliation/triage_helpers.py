"""Dead letters made the way the app makes them, and operator personas, for the triage tests."""

from __future__ import annotations

import itertools
from typing import Any

from django.contrib.auth.models import Group, User
from django.test import Client

from bots.models import Bot, ConsumerRun, InboundUpdate, RunState
from outbox import services as outbox_services
from outbox.models import DeadLetter, ErrorClass, OutboundMessage, State
from outbox.sending import single
from tests.reconciliation.factories import message_row, stored_update

_keys = itertools.count(1)


def failed_by_sandbox(
    sandbox: Any, bot: Bot, *, text: str = "Your order #1 is ready, Alice", chat_id: int = 4242, key: str | None = None
) -> DeadLetter:
    """Enqueue and send through the real send path while the sandbox answers 403 once."""
    message, _ = outbox_services.outbound_message_enqueue(
        bot_id=bot.pk,
        chat_id=chat_id,
        payload={"text": text},
        idempotency_key=key or f"order:{next(_keys)}",
        trace_id=f"trace-{next(_keys)}",
    )
    sandbox.fault("403", count=1)
    result = single.outbound_message_send(message.pk)
    assert result.status == "dead-lettered"
    return DeadLetter.objects.get(message=message)


def failed_row(bot: Bot, *, reason_class: str = ErrorClass.EXHAUSTED, chat_id: int = 4242, **fields: Any) -> DeadLetter:
    """A failed message and its dead letter, written directly (many of them, cheaply)."""
    n = next(_keys)
    message = message_row(
        bot,
        key=f"bulk:{n}",
        state=State.FAILED,
        chat_id=chat_id,
        attempts=8,
        last_error="Bad Gateway",
        last_error_class=reason_class,
        **fields,
    )
    return DeadLetter.objects.create(
        bot=bot,
        message=message,
        reason_class=reason_class,
        first_error="Bad Gateway",
        last_error="Bad Gateway",
        trace_id=f"t{n}",
        chat_id=chat_id,
        idempotency_key=message.idempotency_key,
    )


def failed_run(
    bot: Bot, *, consumer: str = "auto_reply", error: str = "CRM down", update: InboundUpdate | None = None
) -> DeadLetter:
    """A consumer run that used up its attempts on `update` (a stored message by default),
    and its dead letter; `error` is its last."""
    update = update or stored_update(bot)
    run = ConsumerRun.objects.create(
        update=update,
        bot=bot,
        consumer=consumer,
        state=RunState.FAILED,
        attempts=5,
        next_attempt_at=update.received_at,
        trace_id=update.trace_id,
        last_error=f"RuntimeError: {error}",
        last_error_class="exhausted",
    )
    return DeadLetter.objects.create(
        bot=bot,
        consumer_run=run,
        consumer=consumer,
        reason_class=ErrorClass.EXHAUSTED,
        last_error=error,
        trace_id=update.trace_id,
        chat_id=update.chat_id,
        idempotency_key=f"upd:{update.update_id}:{consumer}",
    )


def ensure_groups() -> None:
    """The groups come from a data migration; a transactional test's flush removes them."""
    import importlib

    from django.apps import apps

    if Group.objects.filter(name__in=["Operator", "Developer"]).count() < 2:
        importlib.import_module("reconciliation.migrations.0004_operator_groups").create_groups(apps, None)
        importlib.import_module("reconciliation.migrations.0006_cancel_message_permission").grant(apps, None)


def persona(name: str, group: str | None = None, *, superuser: bool = False) -> User:
    ensure_groups()
    user = User.objects.create_user(name, password=name, is_staff=True, is_superuser=superuser)
    if group:
        user.groups.add(Group.objects.get(name=group))
    return user


def logged_in(user: User, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def message_of(letter: DeadLetter) -> OutboundMessage:
    return OutboundMessage.objects.get(pk=letter.message_id)


def send_now(message_id: int) -> str:
    """outbound_message_send in-process, waiting out the per-chat rate limit slot."""
    from tests.support import wait_until

    return wait_until(
        lambda: (status := single.outbound_message_send(message_id).status) not in ("rate-limited", "not-due")
        and status,
        timeout=5,
        interval=0.1,
    )
