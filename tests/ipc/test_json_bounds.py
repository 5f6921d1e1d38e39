"""JSON bounded before it is parsed (ipc/json_bounds.py): the depth counted without parsing is
the depth the parser builds, for any JSON value (strings full of brackets, quotes and
backslashes included); texts over either limit are refused naming it, and nothing deep ever
reaches the parser."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.ipc import json_bounds

TRICKY = st.text(alphabet=st.sampled_from('[]{}"\\/ab\n\u00e9\U0001f600'), max_size=12)
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
                      max_leaves=40)


def nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max((nesting(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((nesting(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(VALUES, st.booleans())
def test_the_counted_depth_is_the_parsed_depth(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json_bounds.depth(text) == nesting(json.loads(text))
    assert json_bounds.depth(text.encode("utf-8")) == nesting(value)


@settings(max_examples=100, deadline=None)
@given(VALUES, st.integers(0, 8))
def test_loads_refuses_exactly_the_texts_deeper_than_the_limit(value, limit):
    text = json.dumps(value)
    if nesting(value) > limit:
        with pytest.raises(json_bounds.JsonBoundsError, match=f"more than {limit} levels deep"):
            json_bounds.loads(text, 1 << 20, limit)
    else:
        assert json_bounds.loads(text, 1 << 20, limit) == json.loads(text)


def test_a_text_past_the_parsers_recursion_is_refused_before_it():
    for text in ("[" * 100_000, '{"a":' * 50_000, "[" * 10_000 + "]" * 10_000):
        with pytest.raises(json_bounds.JsonBoundsError, match="levels deep"):
            json_bounds.loads(text, 1 << 20)


def test_brackets_inside_strings_and_across_chunks_do_not_count():
    inside = json.dumps(["[" * 3_000_000 + '\\"' + "{" * 10])  # longer than a chunk, escapes included
    assert json_bounds.depth(inside) == 1
    assert json_bounds.problem(inside, 1 << 30) == ""
    across = [[["x" * (1 << 20)], [[1]]]]
    assert json_bounds.depth(json.dumps(across)) == nesting(across) == 4


def test_a_text_over_the_size_limit_is_refused_naming_it():
    assert json_bounds.problem("[1, 2, 3]", 5, what="the body") == "the body is 9 bytes long; at most 5 are read"
    with pytest.raises(ValueError, match="at most 5"):
        json_bounds.loads(b"[1, 2, 3]", 5)


def test_invalid_json_is_the_parsers_error():
    with pytest.raises(ValueError) as e:
        json_bounds.loads("[1, 2", 100)
    assert not isinstance(e.value, json_bounds.JsonBoundsError)
