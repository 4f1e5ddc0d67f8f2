"""The forms of the operators' buttons: every one asks for a reason, kept in the audit log."""

from __future__ import annotations

import json
from typing import Any

from django import forms

from bots.models import Bot
from core.payloads import MAX_JSON_DEPTH, json_depth
from outbox.models import DeadLetter, ErrorClass


class ReasonForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}), help_text="Required. Kept in the audit log."
    )


class RetryForm(ReasonForm):
    corrected_payload = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 8, "cols": 60, "class": "vLargeTextField"}),
        help_text="Edit and retry: a corrected payload as a JSON object. Saved as a new version; the original stays.",
    )

    def clean_corrected_payload(self) -> dict[str, Any] | None:
        raw = (self.cleaned_data.get("corrected_payload") or "").strip()
        if not raw:
            return None
        # As deep as the webhook takes an update, and as deep as every page shows a payload.
        too_deep = f"nested deeper than {MAX_JSON_DEPTH} levels"
        try:
            value = json.loads(raw)
        except RecursionError as exc:
            # json's decoder gives up around a thousand levels.
            raise forms.ValidationError(too_deep) from exc
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise forms.ValidationError("the payload must be a JSON object")
        if json_depth(value, stop_above=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise forms.ValidationError(too_deep)
        return value


class BulkRetryForm(ReasonForm):
    pass


class RecoverSinceForm(ReasonForm):
    bot = forms.ModelChoiceField(queryset=Bot.objects.all(), required=False)
    consumer = forms.CharField(required=False, help_text="A consumer name; with or without a bot.")
    reason_class = forms.ChoiceField(choices=ErrorClass.choices, label="Dead-letter reason")
    since = forms.DateTimeField(
        help_text="Dead letters created at or after this time (YYYY-MM-DD HH:MM, server time zone).",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if not data.get("bot") and not data.get("consumer"):
            raise forms.ValidationError("Choose a bot or a consumer.")
        return data


class MarkDeliveredForm(ReasonForm):
    telegram_message_id = forms.IntegerField(
        required=False, min_value=1, help_text="Telegram's message id, if you found the message in the chat."
    )


class DeadLetterForm(forms.ModelForm):
    class Meta:
        model = DeadLetter
        fields = ["owner"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Owners are the people who triage: active staff. API clients are users too (a token,
        # no password, not staff) and must not be offered, nor accepted from a crafted POST.
        owner = self.fields.get("owner")
        if owner is None:  # a viewer's read-only form
            return
        owner.queryset = owner.queryset.filter(is_staff=True, is_active=True).order_by("username")
        owner.help_text = "The operator (an active staff user) looking after this dead letter."
