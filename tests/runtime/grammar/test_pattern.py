"""A JSON Schema `pattern` rewritten for a grammar (runtime/grammar/pattern.py): every string the
rewritten regex spells, read back as the JSON string it is written as, is one Python's `re`
(what jsonschema uses) finds the pattern in; `\\d` stays ASCII; what no automaton holds is
refused by name; and a nesting or length bomb is refused before the recursive parser sees it."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from kvrt.runtime.grammar.pattern import PatternError, bounded, to_rx, widths
from kvrt.runtime.grammar.rx import Budget

BIG = Budget(1 << 40)


def narrow(text: str) -> str:
    """The same regex over fewer characters (classes cut at U+017F): what it spells is still
    what the grammar spells, and hypothesis draws from Unicode-wide classes very slowly."""
    text = re.sub(r"\\u(?:e000|202a)-\\[uU][0-9a-f]+", "", text)
    return re.sub(r"-\\u(?:d7ff|2027)", r"-\\u017f", text)


PATTERNS = [r"^\d{3}-\d{4}$", r"^[a-z]+(-[a-z]+)*$", r'^[^"\\]{1,5}$', r"a.b", r'x"y\\z', r"^(cat|dog)s?$",
            r"\w+@\w+\.com", r"^\s*\S+\s*$", r"[^0-9]\D", r"^#[0-9a-fA-F]{6}$", r"^v?\d+(\.\d+){0,2}$", r"é+ü?"]


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_what_the_rewritten_pattern_spells_holds_under_re(pattern, data):
    rx = to_rx(pattern, BIG, in_json=True, search=True)
    body = data.draw(st.from_regex(re.compile(narrow(rx.text)), fullmatch=True))
    decoded = json.loads('"' + body + '"')  # the grammar writes JSON string content
    assert re.search(pattern, decoded), (pattern, body, decoded)
    assert not re.search(r"[^\x00-\x7f]\d|[٠-٩]", decoded) or "é" in pattern


@settings(max_examples=60, deadline=None)
@given(st.from_regex(re.compile(to_rx(r"\d+", BIG, in_json=False, search=True).text), fullmatch=True))
def test_digits_are_ascii(text):
    assert text.isascii() and text.isdigit()


@pytest.mark.parametrize("pattern, words", [
    (r"(?=a)b", "look-arounds"), (r"(a)\1", "back-references"), (r"a\bb", "word boundary"),
    (r"(?i)abc", "inline flags"), (r"a^b", "only supported at the pattern's ends"), ("(" * 100 + ")" * 100, "nest"),
    ("a" * 5000, "longer than"), ("a(", "not a regex"),
])
def test_what_no_automaton_holds_is_refused_by_name(pattern, words):
    with pytest.raises(PatternError, match=words):
        to_rx(pattern, BIG, in_json=True, search=True)


def test_widths_and_a_single_repeat_narrowed_to_length_bounds():
    assert widths(r"^\d{3}-\d{4}$", True) == (8, 8)
    assert widths(r"^[a-z]+$", True) == (1, None)
    rx = bounded(r"^[a-z]+$", 3, 5, BIG)
    assert re.fullmatch(rx.text, "abc") and re.fullmatch(rx.text, "abcde") and not re.fullmatch(rx.text, "ab")
    assert not re.fullmatch(rx.text, "abcdef")
    assert bounded(r"^[a-z]+-[a-z]$", 3, 5, BIG) is None  # not one repeated character: the caller refuses
