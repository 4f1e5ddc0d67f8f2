"""The operators' admins of other apps' models, each registered once, here: outbox and bots
define the base classes (outbox/admin.py, bots/admin.py) and register none of these three,
because the buttons below call reconciliation services, which they cannot import. (The fourth,
outbox's DeadLetter, is registered by dead_letters.py.)

- OutboundMessage: payload read-only and masked; Cancel and Cancel broadcast.
- InboundUpdate: payload masked.
- Bot: pause / resume of its circuit, and an audited credential change.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path, reverse

from bots.admin import BotAdmin, InboundUpdateAdmin
from bots.models import Bot, InboundUpdate
from core.ids import int64_or_none
from outbox import services as outbox_services
from outbox.admin import OutboundMessageAdmin
from outbox.circuits import bot_scope
from outbox.models import OutboundMessage, State
from reconciliation import services
from reconciliation.admin.confirm import confirm_page
from reconciliation.admin.forms import ReasonForm
from reconciliation.admin.payloads import mark_viewer, payload_for
from reconciliation.admin.permissions import CANCEL_PERMISSION, PAUSE_PERMISSION

WAITING_STATES = (State.PENDING, State.RETRY)


@admin.register(OutboundMessage)
class MaskedOutboundMessageAdmin(OutboundMessageAdmin):
    """Payload read-only (corrections go through edit-and-retry) and masked without permission.
    Cancel (this message) and Cancel broadcast (every waiting message with its broadcast key)."""

    change_form_template = "reconciliation/admin/outboundmessage_change_form.html"

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None) -> Any:
        message_id = int64_or_none(object_id)
        message = (
            OutboundMessage.objects.filter(pk=message_id).only("state", "broadcast").first()
            if message_id is not None
            else None
        )
        may = message is not None and request.user.has_perm(CANCEL_PERMISSION)
        extra = {
            "can_cancel": may and message.state in WAITING_STATES,
            "can_cancel_broadcast": may and bool(message.broadcast),
        }
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("<int:pk>/cancel/", view(self.cancel_view), name="outbox_outboundmessage_cancel"),
            path(
                "<int:pk>/cancel-broadcast/",
                view(self.cancel_broadcast_view),
                name="outbox_outboundmessage_cancel_broadcast",
            ),
            *super().get_urls(),
        ]

    def _message(self, request: HttpRequest, pk: int) -> OutboundMessage:
        message = get_object_or_404(OutboundMessage.objects.select_related("bot"), pk=pk)
        if not (self.has_view_permission(request, message) and request.user.has_perm(CANCEL_PERMISSION)):
            raise PermissionDenied
        return message

    def _back(self, message: OutboundMessage) -> HttpResponseRedirect:
        return HttpResponseRedirect(reverse("admin:outbox_outboundmessage_change", args=[message.pk]))

    def cancel_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        message = self._message(request, pk)
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            reason = form.cleaned_data["reason"]
            ok = outbox_services.outbound_message_cancel(message.pk, reason=f"cancelled by {request.user}: {reason}")
            outcome = "cancelled" if ok else "not waiting any more; nothing changed"
            services.audit_record(
                actor=request.user,
                action="message.cancel",
                target=f"outbox.OutboundMessage:{message.pk}",
                reason=reason,
                outcome=outcome,
            )
            if ok:
                self.log_change(request, message, f"cancelled: {reason}")
                messages.success(request, f"Message {message.pk} cancelled.")
            else:
                messages.warning(request, f"Message {message.pk} is not waiting any more; nothing changed.")
            return self._back(message)
        return confirm_page(
            request,
            self,
            title=f"Cancel message {message.pk}",
            form=form,
            obj=message,
            intro=f"{message.method} to chat {message.chat_id}, {message.get_state_display()}: it will not be sent. "
            "A message already being sent cannot be cancelled.",
            submit="Cancel the message",
            danger=True,
        )

    def cancel_broadcast_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        message = self._message(request, pk)
        if not message.broadcast:
            raise PermissionDenied
        waiting = OutboundMessage.objects.filter(
            bot_id=message.bot_id, broadcast=message.broadcast, state__in=WAITING_STATES
        )
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            reason = form.cleaned_data["reason"]
            n = outbox_services.outbound_broadcast_cancel(
                bot_id=message.bot_id, broadcast=message.broadcast, reason=f"cancelled by {request.user}: {reason}"
            )
            services.audit_record(
                actor=request.user,
                action="broadcast.cancel",
                target=f"outbox.broadcast:{message.bot_id}:{message.broadcast}",
                reason=reason,
                outcome=f"{n} waiting messages cancelled",
                details={"bot": message.bot_id, "broadcast": message.broadcast, "cancelled": n},
            )
            self.log_change(request, message, f"broadcast {message.broadcast} cancelled ({n} messages): {reason}")
            messages.success(request, f"Broadcast {message.broadcast}: {n} waiting messages cancelled.")
            return self._back(message)
        return confirm_page(
            request,
            self,
            title=f"Cancel broadcast {message.broadcast}",
            form=form,
            obj=message,
            intro=f"{waiting.count()} messages of bot {message.bot} in this broadcast are still waiting: none of them "
            "will be sent. Messages already sent or being sent stay as they are.",
            submit="Cancel the broadcast",
            danger=True,
        )

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = [f for f in super().get_fields(request, obj) if f != "payload"]
        return [*fields, "payload_view"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is None:
            return [*super().get_readonly_fields(request, obj), "payload_view"]
        return [f.name for f in OutboundMessage._meta.fields if f.name != "payload"] + ["payload_view"]

    @admin.display(description="payload")
    def payload_view(self, obj: OutboundMessage) -> str:
        return payload_for(obj, obj.payload)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        return mark_viewer(request, super().get_object(request, object_id, from_field))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # messages come through the API or consumers, with a key


@admin.register(InboundUpdate)
class MaskedInboundUpdateAdmin(InboundUpdateAdmin):
    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f for f in super().get_readonly_fields(request, obj) if f != "payload"] + ["payload_view"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f for f in super().get_fields(request, obj) if f != "payload"] + ["payload_view"]

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        return mark_viewer(request, super().get_object(request, object_id, from_field))

    @admin.display(description="payload")
    def payload_view(self, obj: InboundUpdate) -> str:
        return payload_for(obj, obj.payload)


@admin.register(Bot)
class OperatorBotAdmin(BotAdmin):
    change_form_template = "reconciliation/admin/bot_change_form.html"

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None) -> Any:
        from outbox.models import Circuit

        bot_id = int64_or_none(object_id)
        scope = bot_scope(bot_id) if bot_id is not None else ""
        circuit = Circuit.objects.filter(scope=scope).first() if scope else None
        extra = {
            "circuit": circuit,
            "can_pause": request.user.has_perm(PAUSE_PERMISSION),
            "circuit_scope": scope,
        }
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """A credential change is audited (which one, by whom), never its value."""
        before = Bot.objects.filter(pk=obj.pk).values("token", "webhook_secret").first() if change else None
        super().save_model(request, obj, form, change)
        if before is None:
            return
        changed = [name for name in ("token", "webhook_secret") if before[name] != getattr(obj, name)]
        if changed:
            services.audit_record(
                actor=request.user,
                action="bot.credentials_changed",
                target=f"bots.Bot:{obj.pk}",
                outcome="changed: " + ", ".join(changed),
                details={"fields": changed},
            )
