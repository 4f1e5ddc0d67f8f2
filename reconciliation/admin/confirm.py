"""The confirmation step every operator button goes through before it changes anything."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest
from django.template.response import TemplateResponse

CONFIRM_TEMPLATE = "reconciliation/admin/confirm.html"


def confirm_page(
    request: HttpRequest,
    model_admin: admin.ModelAdmin,
    *,
    title: str,
    form: forms.Form,
    obj: Any = None,
    intro: str = "",
    submit: str = "Confirm",
    danger: bool = False,
    extra: dict[str, Any] | None = None,
) -> TemplateResponse:
    """The confirmation step of every operator action: a form that POSTs with CSRF."""
    context = {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "intro": intro,
        "form": form,
        "object": obj,
        "opts": model_admin.model._meta,
        "submit_label": submit,
        "danger": danger,
        "cancel_url": request.META.get("HTTP_REFERER") or "..",
        **(extra or {}),
    }
    return TemplateResponse(request, CONFIRM_TEMPLATE, context)
