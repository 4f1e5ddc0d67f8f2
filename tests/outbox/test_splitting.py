"""The splitter (outbox/splitting.py), by property: whatever the text, every part fits Telegram's
limit in UTF-16 units, nothing but the whitespace at the cuts is lost, cuts prefer paragraphs,
symbols are not cut, and formatting (entities, HTML) follows each character into its part.
Pure functions: no database."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from outbox.splitting import (
    TEXT_LIMIT,
    CannotSplit,
    Split,
    part_key,
    split_message_payload,
    split_text,
    utf16_len,
    visible_text,
)

WHITESPACE = " \t\n\r\f\v"
RUN = re.compile(r"[ \t\n\r\f\v]+")
# Letters, a wide letter, astral emoji (2 UTF-16 units), a combining accent, a skin tone.
ALPHABET = ["a", "b", "Z", "é", "я", "中", "😀", "👍", "\U0001f3fd", "\u0301", "&", "<"]
words = st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=12)
gaps = st.sampled_from([" ", "  ", "\n", "\n\n", " \n \n", "\t", "\r\n\r\n"])


@st.composite
def texts(draw: st.DrawFn, min_words: int = 1, max_words: int = 60) -> str:
    n = draw(st.integers(min_words, max_words))
    out = [draw(words)]
    for _ in range(n - 1):
        out += [draw(gaps), draw(words)]
    lead = draw(st.sampled_from(["", " ", "\n"]))
    trail = draw(st.sampled_from(["", " ", "\n\n"]))
    return lead + "".join(out) + trail


limits = st.integers(min_value=2, max_value=40)


def joined(split: Split, parts: list[str] | None = None) -> str:
    parts = [p.text for p in split.parts] if parts is None else parts
    out = split.separators[0]
    for part, sep in zip(parts, split.separators[1:], strict=True):
        out += part + sep
    return out


def starts(split: Split, parts: list[str] | None = None) -> list[int]:
    """Where each part starts in the original (code points)."""
    parts = [p.text for p in split.parts] if parts is None else parts
    pos, out = len(split.separators[0]), []
    for part, sep in zip(parts, split.separators[1:], strict=True):
        out.append(pos)
        pos += len(part) + len(sep)
    return out


def fitting_prefix(text: str, start: int, limit: int) -> int:
    """The end of the longest piece of text from `start` that fits `limit` units."""
    end, units = start, 0
    while end < len(text) and units + utf16_len(text[end]) <= limit:
        units += utf16_len(text[end])
        end += 1
    return end


# --- plain text --------------------------------------------------------------------------------


@given(text=texts(), limit=limits)
@example(text="😀" * 5, limit=3)
@example(text="a" * 10, limit=2)
def test_every_part_fits_the_limit_in_utf16_units_and_is_not_blank(text: str, limit: int) -> None:
    split = split_text(text, limit=limit)

    for part in split.parts:
        assert 0 < utf16_len(part.text) <= limit
        assert part.text.strip(WHITESPACE)


@given(text=texts(), limit=limits)
def test_parts_joined_with_the_removed_whitespace_give_back_the_text(text: str, limit: int) -> None:
    split = split_text(text, limit=limit)

    assert joined(split) == text
    assert len(split.separators) == len(split.parts) + 1
    assert all(set(sep) <= set(WHITESPACE) for sep in split.separators)
    if len(split.parts) > 1:
        # Only whitespace is cut away, all of it at the cut: no part starts or ends with it.
        assert all(p.text[0] not in WHITESPACE and p.text[-1] not in WHITESPACE for p in split.parts)


@given(text=texts(max_words=8))
def test_a_text_within_the_limit_is_one_part_unchanged(text: str) -> None:
    entities = [{"type": "bold", "offset": 0, "length": 1}]

    assert split_text(text).parts[0].text == text
    assert split_text(text).separators == ["", ""]
    assert split_text(text, entities=entities).parts[0].entities == entities
    assert split_text(text, parse_mode="HTML").parts[0].text == text
    assert split_message_payload({"text": text, "reply_markup": {"x": 1}}) == [{"text": text, "reply_markup": {"x": 1}}]


@given(text=texts(min_words=2), limit=st.integers(min_value=6, max_value=40))
def test_a_cut_prefers_a_paragraph_then_a_line_then_a_space_in_range(text: str, limit: int) -> None:
    split = split_text(text, limit=limit)
    if len(split.parts) == 1:
        return
    runs = [(m.start(), m.group()) for m in RUN.finditer(text)]
    for start, sep in zip(starts(split), split.separators[1:-1], strict=False):
        end = fitting_prefix(text, start, limit)
        in_range = [run for at, run in runs if start < at <= end]
        if any(run.count("\n") >= 2 for run in in_range):
            assert sep.count("\n") >= 2
        elif any("\n" in run for run in in_range):
            assert "\n" in sep
        elif in_range:
            assert sep
        else:
            assert sep == ""  # a word longer than the limit, cut inside


@given(
    emoji=st.sampled_from(["😀", "👍\U0001f3fd", "e\u0301", "👨\u200d👩\u200d👧"]),
    n=st.integers(10, 400),
    limit=st.integers(8, 64),
)
def test_emoji_and_accented_letters_are_never_cut_when_a_cut_between_symbols_exists(
    emoji: str, n: int, limit: int
) -> None:
    text = emoji * n  # one long word: every cut is inside it
    split = split_text(text, limit=limit)

    assert joined(split) == text
    for part in split.parts:
        part.text.encode("utf-16-le")  # no lone surrogate
        assert len(part.text) % len(emoji) == 0, "a symbol was cut"


def test_a_word_longer_than_the_limit_is_cut_inside_only_as_a_last_resort() -> None:
    text = "short words here " + "x" * 30

    split = split_text(text, limit=20)

    assert [p.text for p in split.parts] == ["short words here", "x" * 20, "x" * 10]


def test_a_cut_at_4096_counts_emoji_as_two_units() -> None:
    text = "😀" * 2049  # 4,098 UTF-16 units, 2,049 code points

    split = split_text(text)

    assert [utf16_len(p.text) for p in split.parts] == [4096, 2]
    assert utf16_len(split_text("😀" * 2048).parts[0].text) == TEXT_LIMIT


# --- entities ----------------------------------------------------------------------------------


def coverage(text: str, entities: list[dict]) -> list[frozenset[str]]:
    """For each code point, the ids of the entities covering it (offsets in UTF-16 units)."""
    out, unit = [], 0
    for ch in text:
        out.append(frozenset(e["id"] for e in entities if e["offset"] <= unit < e["offset"] + e["length"]))
        unit += utf16_len(ch)
    return out


@st.composite
def texts_with_entities(draw: st.DrawFn) -> tuple[str, list[dict]]:
    text = draw(texts(min_words=2))
    bounds = [0]
    for ch in text:
        bounds.append(bounds[-1] + utf16_len(ch))  # entity edges on code point boundaries
    entities = []
    for n in range(draw(st.integers(0, 6))):
        a, b = sorted(draw(st.lists(st.sampled_from(bounds), min_size=2, max_size=2)))
        if b > a:
            kind = draw(st.sampled_from(["bold", "italic", "text_link", "pre"]))
            entity = {"type": kind, "offset": a, "length": b - a, "id": f"e{n}"}
            if kind == "text_link":
                entity["url"] = "https://example.org/"
            entities.append(entity)
    return text, entities


@given(case=texts_with_entities(), limit=limits)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_entities_are_rebased_to_each_part_in_utf16_units(case: tuple[str, list[dict]], limit: int) -> None:
    text, entities = case
    split = split_text(text, limit=limit, entities=entities)

    original = coverage(text, entities)
    kept = []
    for start, part in zip(starts(split), split.parts, strict=True):
        assert part.entities is not None
        for entity in part.entities:
            assert entity["length"] > 0
            assert entity["offset"] + entity["length"] <= utf16_len(part.text)
            source = next(e for e in entities if e["id"] == entity["id"])
            assert {**entity, "offset": 0, "length": 0} == {**source, "offset": 0, "length": 0}
        assert coverage(part.text, part.entities) == original[start : start + len(part.text)]
        kept += coverage(part.text, part.entities)
    assert len(kept) == sum(len(p.text) for p in split.parts)


def test_an_entity_crossing_a_cut_becomes_one_per_part() -> None:
    text = "aaaa bbbb cccc"
    bold = {"type": "bold", "offset": 2, "length": 10}

    split = split_text(text, limit=9, entities=[bold])

    assert [p.text for p in split.parts] == ["aaaa bbbb", "cccc"]
    assert [p.entities for p in split.parts] == [
        [{"type": "bold", "offset": 2, "length": 7}],
        [{"type": "bold", "offset": 0, "length": 2}],
    ]


# --- HTML --------------------------------------------------------------------------------------

TAGS = [("b", "<b>"), ("i", "<i>"), ("a", '<a href="https://example.org/?a=1&amp;b=2">'), ("code", "<code>")]
HTML_CHARS = ["a", "я", "😀", "&amp;", "&lt;", "&#128512;", "&quot;"]
html_words = st.lists(st.sampled_from(HTML_CHARS), min_size=1).map("".join)


@st.composite
def html_texts(draw: st.DrawFn, depth: int = 0) -> str:
    out = []
    for _ in range(draw(st.integers(1, 8))):
        if depth < 3 and draw(st.booleans()):
            name, opening = draw(st.sampled_from(TAGS))
            out.append(f"{opening}{draw(html_texts(depth + 1))}</{name}>")
        else:
            out.append(draw(html_words))
        out.append(draw(gaps))
    return "".join(out).strip(WHITESPACE) or "x"


def formatting(html: str) -> list[tuple[str, tuple[str, ...]]]:
    """Each visible character with the tags around it; fails on unbalanced markup."""
    out: list[tuple[str, tuple[str, ...]]] = []
    stack: list[str] = []
    for token in re.finditer(r"<(/?)(\w+)[^>]*>|&[^;]+;|.", html, re.DOTALL):
        if token.group(2):
            if token.group(1):
                assert stack, f"unbalanced in {html!r}"
                assert stack[-1] == token.group(2), f"unbalanced in {html!r}"
                stack.pop()
            else:
                stack.append(token.group(2))
        else:
            out += [(ch, tuple(stack)) for ch in visible_text(token.group(), "HTML")]
    assert not stack, f"unclosed {stack} in {html!r}"
    return out


@given(html=html_texts(), limit=limits)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_html_is_measured_as_telegram_shows_it_and_each_part_keeps_its_formatting(html: str, limit: int) -> None:
    split = split_text(html, limit=limit, parse_mode="HTML")

    visible = [visible_text(p.text, "HTML") for p in split.parts]
    assert all(0 < utf16_len(v) <= limit for v in visible)
    assert joined(split, visible) == visible_text(html, "HTML")
    original = formatting(html)
    for start, part in zip(starts(split, visible), split.parts, strict=True):
        mine = formatting(part.text)  # balanced: every part opens and closes what it uses
        assert mine == original[start : start + len(mine)]


def test_an_html_element_open_at_a_cut_is_closed_and_reopened() -> None:
    html = '<b>bold <a href="https://x.org/">linked words</a></b> tail'

    split = split_text(html, limit=12, parse_mode="HTML")

    assert [p.text for p in split.parts] == [
        '<b>bold <a href="https://x.org/">linked</a></b>',
        '<b><a href="https://x.org/">words</a></b> tail',
    ]


def test_html_that_cannot_be_followed_is_refused_only_when_it_must_be_split() -> None:
    assert split_text("1 < 2", parse_mode="HTML").parts[0].text == "1 < 2"
    with pytest.raises(CannotSplit, match="stray '<'"):
        split_text("1 < 2 " * 1000, parse_mode="HTML")
    with pytest.raises(CannotSplit, match="closes no open"):
        split_text("<b>x</i> " * 3000, parse_mode="HTML")


def test_markdown_is_measured_leniently_and_never_split() -> None:
    fits = "*" + "a" * 4096 + "*"  # 4,096 once the markup is parsed

    assert split_text(fits, parse_mode="MarkdownV2").parts[0].text == fits
    with pytest.raises(CannotSplit, match="HTML or with entities"):
        split_text("a" * 4097, parse_mode="MarkdownV2")


# --- payloads and keys -------------------------------------------------------------------------


def test_a_split_payload_puts_the_reply_on_the_first_part_and_the_buttons_on_the_last() -> None:
    payload = {
        "text": "one\n\ntwo\n\nthree",
        "reply_parameters": {"message_id": 7},
        "reply_markup": {"inline_keyboard": [[{"text": "OK", "callback_data": "ok"}]]},
        "disable_notification": True,
        "parse_mode": "HTML",
    }

    parts = split_message_payload(payload, limit=5)

    assert [p["text"] for p in parts] == ["one", "two", "three"]
    assert ["reply_parameters" in p for p in parts] == [True, False, False]
    assert ["reply_markup" in p for p in parts] == [False, False, True]
    assert all(p["disable_notification"] and p["parse_mode"] == "HTML" for p in parts)


def test_part_keys_derive_from_the_key_and_fit_255_characters() -> None:
    assert part_key("upd:1:auto_reply:0", 2) == "upd:1:auto_reply:0#2"
    long = part_key("k" * 255, 12)
    assert len(long) <= 255
    assert long.endswith("#12")
    assert long == part_key("k" * 255, 12) != part_key("k" * 254 + "j", 12)


@pytest.mark.parametrize(
    "payload",
    [
        {"text": "word " * 1000, "parse_mode": 5},
        {"text": "word " * 1000, "entities": [{"type": "bold", "offset": "0", "length": 3}]},
        {"text": "word " * 1000, "entities": ["bold"]},
        {"text": " " * 5000},
    ],
)
def test_malformed_options_of_a_text_to_split_are_refused_clearly(payload) -> None:
    with pytest.raises(CannotSplit, match=r"must be|only whitespace"):
        split_message_payload(payload)
