"""A python-telegram-bot application run as a Dovecote consumer: each stored update is fed to
the bot's `Application.process_update`, its Bot API calls answered and journaled
(bots/ptb/calls.py), and the run marked done once the handling is complete."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import telegram
import telegram.ext as tx
from django.db import transaction
from django.utils import timezone

from bots import transitions
from bots.models import ConsumerRun, RunState
from bots.ptb import calls, persistence
from bots.ptb.app import JobQueueUnavailable, load_application
from bots.ptb.loop import run_coroutine
from bots.registry import ConsumerContext, Defer, PermanentError, TransientError
from core.failpoints import failpoint
from core.workers import worker_id

logger = logging.getLogger(__name__)


@dataclass
class PtbApp:
    """A consumer's application: how to build it, and the one built in this process."""

    consumer: str
    bot: str
    main: str | None = None
    setup: str | None = None
    serial: str | None = None
    _application: tx.Application | None = field(default=None, repr=False)

    def application(self) -> tx.Application:
        if self._application is None:
            application = load_application(bot=self.bot, main=self.main, setup=self.setup)
            application.add_error_handler(_note_error)
            self._application = application
        return self._application


async def _note_error(update: object, context: tx.CallbackContext) -> None:
    """Every application gets this error handler (after its own): a handler's failure is the
    run's failure, not a line in a log."""
    handling = calls.current.get()
    if handling is not None and context.error is not None:
        handling.errors.append(context.error)


# A run waiting for its chat's earlier run looks again after this long, if the earlier run's
# wake-up (on its completion) did not come first: a run that failed for good wakes nobody.
CHAT_WAIT_SECONDS = 5.0
_UNFINISHED = [RunState.PENDING, RunState.RUNNING, RunState.RETRY]


def handle_update(app: PtbApp, ctx: ConsumerContext) -> str:
    serial = app.serial == "chat" and ctx.update.chat_id is not None
    if serial and _earlier_run_unfinished(ctx):
        raise Defer(timezone.now() + timedelta(seconds=CHAT_WAIT_SECONDS), reason="waiting for the chat's earlier run")
    application = app.application()
    update = telegram.Update.de_json(ctx.update.payload, application.bot)
    conversations = persistence.conversation_keys(application, update)
    snapshot = persistence.Snapshot.load(update=ctx.update, consumer=ctx.consumer, conversations=list(conversations))
    persistence.load_conversations(conversations, snapshot)
    handling = calls.Handling.start(update=ctx.update, consumer=ctx.consumer, trace_id=ctx.trace_id, snapshot=snapshot)
    token = calls.current.set(handling)
    try:
        run_coroutine(_process(application, update))
    except calls.Suspended as wait:
        raise Defer(wait.until, reason=wait.reason[:64]) from None
    except (calls.NotDeterministic, JobQueueUnavailable) as stop:
        raise PermanentError(str(stop)) from None
    finally:
        calls.current.reset(token)
    if handling.errors:
        raise _run_error(handling.errors[0])
    outcome = f"handled ({handling.next_ordinal} calls)"
    failpoint("ptb_before_commit")
    with transaction.atomic():
        snapshot.save()
        run_pk = ConsumerRun.objects.filter(update=ctx.update, consumer=ctx.consumer).values_list("pk", flat=True)[0]
        if not transitions.mark_run_done(run_pk, worker=worker_id(), outcome=outcome):
            # Its lease ran out and another worker has the run: nothing of this one is kept.
            raise TransientError("the run's lease was lost before its completion; nothing of it is kept")
        if serial:
            transaction.on_commit(lambda: _wake_next_in_chat(ctx))
    failpoint("ptb_after_commit")
    return outcome


async def _process(application: tx.Application, update: telegram.Update) -> None:
    """The handling, then the data it changed handed to the persistence (which collects it
    for the run's completion)."""
    await application.process_update(update)
    await application.update_persistence()


def _chat_runs(ctx: ConsumerContext) -> Any:
    """This consumer's unfinished runs of the update's chat."""
    update = ctx.update
    return ConsumerRun.objects.filter(
        consumer=ctx.consumer, bot_id=update.bot_id, update__chat_id=update.chat_id, state__in=_UNFINISHED
    )


def _earlier_run_unfinished(ctx: ConsumerContext) -> bool:
    return _chat_runs(ctx).filter(update_id__lt=ctx.update.pk).exists()


def _wake_next_in_chat(ctx: ConsumerContext) -> None:
    """The chat's next run, waiting for this one, is due now (as the outbox's chat order
    hands a chat's next message on)."""
    from bots.runs import dispatch_run

    following = _chat_runs(ctx).filter(update_id__gt=ctx.update.pk).order_by("update_id").first()
    if following is not None and following.state != RunState.RUNNING:
        transitions.make_run_due(following.pk, now=timezone.now())
        dispatch_run(following.pk, consumer=ctx.consumer)


# Telegram's refusals: the same call gets the same answer (a 429, a 5xx, a lost answer are
# waited out by the journal and never reach a handler as such).
_REFUSALS = (
    telegram.error.BadRequest,
    telegram.error.Forbidden,
    telegram.error.ChatMigrated,
    telegram.error.InvalidToken,
    telegram.error.Conflict,
)


def _run_error(error: BaseException) -> Exception:
    """A handler's failure as the run's: Telegram's refusal is a dead letter at once (a retry
    would be refused again); anything else a failed attempt (its re-run replays the journal,
    so nothing is sent twice)."""
    description = f"{type(error).__name__}: {error}"
    if isinstance(error, _REFUSALS):
        return PermanentError(f"the handler failed on Telegram's answer: {description}")
    return TransientError(f"the handler failed: {description}")


def consumer_func(app: PtbApp) -> Any:
    def run(ctx: ConsumerContext) -> str:
        return handle_update(app, ctx)

    run.__name__ = f"ptb_{app.consumer}"
    return run
