"""Signals reconciliation sends to code above it (developers' own channels)."""

import django.dispatch

# sender=None, kind=<"dead_letters"|"cases"|"circuits">, counts=<dict[str, int]>, text=<str>,
# window=<int>: one ops digest, sent at most once per DOVECOTE_OPS_DIGEST_MINUTES per kind
# (after the window is claimed). Receivers add channels (Slack, a pager) with the same
# throttling; the built-in ones are the Telegram chat (through the outbox) and e-mail.
ops_digest = django.dispatch.Signal()
