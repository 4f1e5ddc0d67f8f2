"""Logging helpers: a trace id on every record, and masking of secrets and personal data.

Logs never carry bot tokens, phone numbers or message text: the filter rewrites the
formatted message and its arguments before any handler sees them.
"""

import contextvars
import logging
import re
from typing import Any

from pythonjsonlogger.json import JsonFormatter

current_trace_id: contextvars.ContextVar[str] = contextvars.ContextVar("dovecote_trace_id", default="")

# 123456789:AAH... - Telegram bot tokens, also inside URLs (/bot<token>/sendMessage, where no
# word boundary precedes the digits).
_TOKEN_RE = re.compile(r"(?<!\d)\d{5,}:[A-Za-z0-9_-]{20,}")
# +7 912 345-67-89, 89123456789, (555) 123-4567 ...
_PHONE_RE = re.compile(r"(?<![\w.])\+?\d[\d\s().-]{8,}\d\b")
# "text": "...", 'caption': '...', text=...
_TEXT_RE = re.compile(
    r"""(?P<key>["']?(?:text|caption|phone_number|first_name|last_name)["']?\s*[:=]\s*)"""
    r"""(?P<val>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^,}\s]+)"""
)


def mask(value: str) -> str:
    """Mask tokens, phone numbers and message text in a log string."""
    value = _TOKEN_RE.sub("<token>", value)
    value = _TEXT_RE.sub(lambda m: f"{m.group('key')}<masked>", value)
    return _PHONE_RE.sub("<phone>", value)


_EMAIL_RE = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
# Keys whose values are what a person wrote or who they are, in a result or an echoed body.
PERSONAL_KEYS = frozenset(
    {
        "text",
        "caption",
        "phone",
        "phone_number",
        "first_name",
        "last_name",
        "username",
        "name",
        "email",
        "content",
        "message",
        "prompt",
    }
)


_PERSONAL_RE = re.compile(
    r"""(?P<key>["']?(?:"""
    + "|".join(sorted(PERSONAL_KEYS))
    + r""")["']?\s*[:=]\s*)(?P<val>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^,}\s]+)"""
)


def redact(value: str) -> str:
    """`mask`, and e-mail addresses: for error texts that may echo a CRM's or a model's body
    (a lead's contacts, the user's words), shown to operators without payload access."""
    value = _PERSONAL_RE.sub(lambda m: f"{m.group('key')}<masked>", mask(value))
    return _EMAIL_RE.sub("<email>", value)


class MaskSecretsFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask(message)
        if masked != message or record.args:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = mask(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = mask(record.exc_text)
        return True


class TraceIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "trace_id", None):
            record.trace_id = current_trace_id.get()
        return True


def _mask_values(value: Any) -> Any:
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {k: _mask_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mask_values(v) for v in value]
    return value


class MaskingJsonFormatter(JsonFormatter):
    """The JSON formatter, masking what it writes: python-json-logger formats the traceback
    again from `exc_info` (the filter's masked `exc_text` is not what it writes), and
    `extra` fields (a task's arguments, an error's body) may carry a token or a text."""

    def formatException(self, ei: Any) -> str:
        return mask(str(super().formatException(ei)))

    def formatStack(self, stack_info: Any) -> str:
        return mask(str(super().formatStack(stack_info)))

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        return {
            key: value if key in _NOT_MASKED else _mask_values(value)
            for key, value in super().process_log_record(log_data).items()
        }


# The formatter's own fields: a timestamp would pass for a phone number.
_NOT_MASKED = frozenset({"time", "asctime", "level", "levelname", "logger", "name", "trace_id"})
