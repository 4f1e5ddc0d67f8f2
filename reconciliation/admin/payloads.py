"""Payloads as the admin shows them: in full (clipped) with `reconciliation.view_payload`,
masked without it. The message, update and payload-version pages all render them here."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html

from core.admin_tools import ReadOnlyAdmin
from core.masking import can_view_payload, shown
from core.payloads import pretty_json
from reconciliation.models import PayloadVersion


def _pretty(value: Any) -> str:
    return format_html("<pre class='dovecote-json'>{}</pre>", pretty_json(value))


def mark_viewer(request: HttpRequest, obj: Any) -> Any:
    """Note on `obj` whether this request's user may see its payload in full (see payload_for)."""
    # Stored on the object, not on the (shared, multi-threaded) ModelAdmin instance.
    if obj is not None:
        obj._dovecote_payload_visible = can_view_payload(request.user)
    return obj


def payload_for(obj: Any, payload: Any) -> str:
    """`payload` rendered for the viewer mark_viewer noted on `obj`: masked if none was noted."""
    return _pretty(shown(payload, visible=getattr(obj, "_dovecote_payload_visible", False)))


@admin.register(PayloadVersion)
class PayloadVersionAdmin(ReadOnlyAdmin):
    list_display = ["message", "number", "author", "reason", "created_at"]
    raw_id_fields = ["message"]
    fields = ["message", "number", "author", "reason", "created_at", "payload_view"]
    readonly_fields = fields

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        return mark_viewer(request, super().get_object(request, object_id, from_field))

    @admin.display(description="payload")
    def payload_view(self, obj: PayloadVersion) -> str:
        return payload_for(obj, obj.payload)
