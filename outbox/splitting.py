"""Splitting an over-long `sendMessage` into parts Telegram accepts. Pure: no Django, no I/O.

Telegram counts length in UTF-16 code units after entity parsing: 4,096 for a message, 1,024
for a caption. `split_text` cuts greedily at the last paragraph break in range, else a line
break, else a space; inside a word only when the word alone is too long (never inside a
surrogate pair). The whitespace at each cut is removed; ``entities`` are re-based to each part;
with ``parse_mode`` HTML the cuts fall in the visible text and open elements are closed and
reopened. Markdown is never split (`CannotSplit` when too long). The precise rules:
docs/DESIGN.md."""

from __future__ import annotations

import bisect
import copy
import hashlib
import html
import itertools
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

TEXT_LIMIT = 4096
CAPTION_LIMIT = 1024
# More parts than this is a mistake upstream (a runaway model, a loop), not a reply.
MAX_PARTS = 100

# Options that belong to the first part only (the answer starts there) or the last one
# (buttons go under the end of the answer). The others apply to every part.
FIRST_PART_ONLY = frozenset(
    {"reply_to_message_id", "reply_parameters", "allow_sending_without_reply", "message_effect_id"}
)
LAST_PART_ONLY = frozenset({"reply_markup"})


class CannotSplit(ValueError):
    """The text is too long and cannot be cut safely as given."""


@dataclass(frozen=True)
class Part:
    text: str
    entities: list[dict[str, Any]] | None = None  # None when the text came without entities


@dataclass(frozen=True)
class Split:
    parts: list[Part]
    separators: list[str]  # len(parts) + 1; see the module docstring


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, as Telegram counts."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


# --- measuring -------------------------------------------------------------------------------

_ATTRS = r"(?:\s(?:[^<>\"']|\"[^\"]*\"|'[^']*')*)?"
_TAG = re.compile(rf"<(/?)([A-Za-z][A-Za-z0-9-]*){_ATTRS}>")
_REF = re.compile(r"&(?:#[0-9]+|#[xX][0-9A-Fa-f]+|[A-Za-z][A-Za-z0-9]*);")
_MD_TOKEN = re.compile(r"\\(.)|```[A-Za-z0-9_+-]*|\]\((?:[^()\\]|\\.)*\)|[*_~|`\[\]]|^>", re.MULTILINE | re.DOTALL)


def visible_text(text: str, parse_mode: str | None = None) -> str:
    """The text as Telegram shows it after parsing `parse_mode` (HTML: tags stripped,
    references unescaped; Markdown: markup characters left out, a lenient estimate)."""
    mode = (parse_mode or "").lower()
    if mode == "html":
        return _REF.sub(lambda m: html.unescape(m.group(0)), _TAG.sub("", text))
    if mode in ("markdown", "markdownv2"):
        return _MD_TOKEN.sub(lambda m: m.group(1) or "", text)
    return text


def visible_length(text: str, parse_mode: str | None = None) -> int:
    """Telegram's length of a text or caption: UTF-16 units after entity parsing."""
    return utf16_len(visible_text(text, parse_mode))


# --- cutting ---------------------------------------------------------------------------------

_SPACE = re.compile(r"[ \t\n\r\f\v]+")
_JOINERS = frozenset({"\u200d", "\u034f", "\u2060"})


def _clings(before: str, after: str) -> bool:
    """True when cutting between these two characters would break one visible symbol."""
    cp = ord(after)
    return (
        before in _JOINERS
        or after in _JOINERS
        or unicodedata.category(after) in ("Mn", "Mc", "Me")
        or 0xFE00 <= cp <= 0xFE0F  # variation selectors
        or 0x1F3FB <= cp <= 0x1F3FF  # skin tones
        or 0xE0020 <= cp <= 0xE007F  # emoji tag sequences
        or 0xE0100 <= cp <= 0xE01EF
    )


def _cumulative_units(text: str) -> list[int]:
    """cum[i] = UTF-16 units in text[:i]."""
    cum = [0]
    for ch in text:
        cum.append(cum[-1] + (2 if ord(ch) > 0xFFFF else 1))
    return cum


def _spans(text: str, cum: list[int], limit: int, atomic: set[int]) -> list[tuple[int, int]]:
    """[start, end) code-point spans of the parts of `text` (already known to be too long).
    A cut never falls at an index in `atomic` (inside one markup reference)."""
    if limit < 2:
        raise ValueError("the limit must hold a surrogate pair")
    runs = [(m.start(), m.end(), m.group().count("\n")) for m in _SPACE.finditer(text)]
    starts = [r[0] for r in runs]
    begin, end = 0, len(text)
    if runs and runs[0][0] == 0:
        begin = runs[0][1]
    if runs and runs[-1][1] == len(text):
        end = runs[-1][0]
    if begin >= end:
        raise CannotSplit("the text is only whitespace")
    spans: list[tuple[int, int]] = []
    pos = begin
    while cum[end] - cum[pos] > limit:
        hard = bisect.bisect_right(cum, cum[pos] + limit) - 1  # the most that fits from pos
        # Whitespace runs starting in (pos, hard]: the latest paragraph break, else line
        # break, else space.
        lo, hi = bisect.bisect_right(starts, pos), bisect.bisect_right(starts, hard)
        best = None
        for want in (2, 1, 0):
            best = next((runs[i] for i in range(hi - 1, lo - 1, -1) if runs[i][2] >= want), None)
            if best is not None:
                break
        if best is not None:
            spans.append((pos, best[0]))
            pos = best[1]
            continue
        cut = _inner_cut(text, pos, hard, atomic)
        spans.append((pos, cut))
        pos = cut
    spans.append((pos, end))
    return spans


def _inner_cut(text: str, pos: int, hard: int, atomic: set[int]) -> int:
    """Where to cut a word longer than the limit: as late as possible, splitting no symbol
    (a base and its combining marks, a joined emoji) and no markup reference."""
    for cut in range(hard, pos, -1):
        if cut not in atomic and not _clings(text[cut - 1], text[cut]):
            return cut
    # One symbol longer than the limit: cut it anyway, but never inside a reference.
    return next((cut for cut in range(hard, pos, -1) if cut not in atomic), hard)


def _rebase(entities: list[dict[str, Any]], units: list[tuple[int, int]]) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = [[] for _ in units]
    for entity in entities:
        offset, length = int(entity["offset"]), int(entity["length"])
        for n, (a, b) in enumerate(units):
            s, t = max(offset, a), min(offset + length, b)
            if t > s:
                out[n].append({**copy.deepcopy(entity), "offset": s - a, "length": t - s})
    return out


def split_text(
    text: str,
    *,
    limit: int = TEXT_LIMIT,
    entities: list[dict[str, Any]] | None = None,
    parse_mode: str | None = None,
) -> Split:
    """Cut `text` into parts of at most `limit` UTF-16 units (see the module docstring)."""
    mode = (parse_mode or "").lower()
    if entities is not None and mode:
        if utf16_len(text) <= limit:
            return Split([Part(text, entities)], ["", ""])
        raise CannotSplit("give either parse_mode or entities, not both, for a text that must be split")
    if mode in ("markdown", "markdownv2"):
        if visible_length(text, parse_mode) <= limit:
            return Split([Part(text)], ["", ""])
        raise CannotSplit(
            f"a {parse_mode} text longer than {limit} UTF-16 units cannot be split safely; "
            "send it with parse_mode HTML or with entities"
        )
    if mode == "html":
        return _split_html(text, limit)
    if utf16_len(text) <= limit:
        return Split([Part(text, entities)], ["", ""])
    if mode:
        raise CannotSplit(f"unknown parse_mode {parse_mode!r}: the text cannot be split safely")
    cum = _cumulative_units(text)
    spans = _spans(text, cum, limit, set())
    separators = _separators(text, spans)
    if entities is None:
        return Split([Part(text[a:b]) for a, b in spans], separators)
    if not all(
        isinstance(e, dict)
        and all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool) for k in ("offset", "length"))
        for e in entities
    ):
        raise CannotSplit("entities must be objects with integer offset and length")
    rebased = _rebase(entities, [(cum[a], cum[b]) for a, b in spans])
    return Split([Part(text[a:b], ents) for (a, b), ents in zip(spans, rebased, strict=True)], separators)


def _separators(text: str, spans: list[tuple[int, int]]) -> list[str]:
    separators = [text[: spans[0][0]]]
    separators += [text[b:a] for (_, b), (a, _) in itertools.pairwise(spans)]
    separators.append(text[spans[-1][1] :])
    return separators


def _split_html(source: str, limit: int) -> Split:
    # Visible text, and for each of its characters the source span of the token it came from.
    visible: list[str] = []
    src_start: list[int] = []
    src_end: list[int] = []
    atomic: set[int] = set()
    tags: list[tuple[int, int, re.Match[str]]] = []
    i = 0
    while i < len(source):
        ch = source[i]
        if ch == "<":
            m = _TAG.match(source, i)
            if m is None:
                if visible_length(source, "HTML") <= limit:
                    return Split([Part(source)], ["", ""])
                raise CannotSplit(f"a stray '<' at {i}: the HTML cannot be split safely (write it as &lt;)")
            tags.append((m.start(), m.end(), m))
            i = m.end()
            continue
        if ch == "&" and (m := _REF.match(source, i)) is not None:
            chars = html.unescape(m.group(0))
            for k, c in enumerate(chars):
                if k:
                    atomic.add(len(visible))
                visible.append(c)
                src_start.append(m.start())
                src_end.append(m.end())
            i = m.end()
            continue
        visible.append(ch)
        src_start.append(i)
        src_end.append(i + 1)
        i += 1
    text = "".join(visible)
    if utf16_len(text) <= limit:
        return Split([Part(source)], ["", ""])
    spans = _spans(text, _cumulative_units(text), limit, atomic)
    separators = _separators(text, spans)

    # Open elements at each source position: replay the tags in order.
    stack: list[tuple[str, str]] = []  # (name, opening tag as written)
    t = 0

    def advance(to: int) -> list[tuple[str, str]]:
        nonlocal t
        while t < len(tags) and tags[t][0] < to:
            start, _, m = tags[t]
            closing, name, self_closing = m.group(1), m.group(2).lower(), m.group(0).endswith("/>")
            if closing:
                if not stack or stack[-1][0] != name:
                    raise CannotSplit(f"</{name}> at {start} closes no open <{name}>: the HTML cannot be split safely")
                stack.pop()
            elif not self_closing:
                stack.append((name, m.group(0)))
            t += 1
        return list(stack)

    parts = []
    for a, b in spans:
        s, e = src_start[a], src_end[b - 1]
        opened = advance(s)
        closed = advance(e)
        body = "".join(tag for _, tag in opened) + source[s:e] + "".join(f"</{name}>" for name, _ in reversed(closed))
        parts.append(Part(body))
    advance(len(source) + 1)
    return Split(parts, separators)


# --- payloads --------------------------------------------------------------------------------


def split_message_payload(payload: dict[str, Any], *, limit: int = TEXT_LIMIT) -> list[dict[str, Any]]:
    """The payloads of a `sendMessage`'s parts, in order: `[payload]` itself when it fits.

    Every part keeps the options that describe how to send (parse_mode, disable_notification,
    protect_content, message_thread_id, link_preview_options, ...); the reply target and a
    message effect go with the first part, `reply_markup` (buttons) with the last."""
    text = payload["text"]
    entities, parse_mode = payload.get("entities"), payload.get("parse_mode")
    if parse_mode is not None and not isinstance(parse_mode, str):
        raise CannotSplit("parse_mode must be a string")
    split = split_text(
        text, limit=limit, entities=entities if isinstance(entities, list) else None, parse_mode=parse_mode
    )
    if len(split.parts) == 1:
        return [payload]
    if len(split.parts) > MAX_PARTS:
        raise CannotSplit(f"the text would take {len(split.parts)} messages; at most {MAX_PARTS} are sent for one")
    last = len(split.parts) - 1
    payloads = []
    for n, part in enumerate(split.parts):
        options = {
            k: v
            for k, v in payload.items()
            if k not in ("text", "entities")
            and (k not in FIRST_PART_ONLY or n == 0)
            and (k not in LAST_PART_ONLY or n == last)
        }
        options["text"] = part.text
        if part.entities:
            options["entities"] = part.entities
        payloads.append(options)
    return payloads


def part_key(key: str, n: int) -> str:
    """The idempotency key of part `n` (2, 3, ...) of the message keyed `key`: stable, at most
    255 characters. The first part keeps `key` itself."""
    derived = f"{key}#{n}"
    if len(derived) <= 255:
        return derived
    return f"part:sha256:{hashlib.sha256(key.encode()).hexdigest()}#{n}"
