"""`{{ value|pretty_json }}`: stored JSON (payloads, results) as JSON, not Python's repr.
Its output is text, escaped by the template like any other."""

from typing import Any

from django import template

from core.payloads import pretty_json as _pretty_json

register = template.Library()


@register.filter
def pretty_json(value: Any) -> str:
    return _pretty_json(value)
