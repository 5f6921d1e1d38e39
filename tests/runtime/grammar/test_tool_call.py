"""The regex a forced tool call is decoded under (runtime/grammar/tool_call.py): every valid call
of an allowed tool matches it, in Python's regex engine and in outlines_core's automaton (the
one guided decoding walks token by token), what it matches parses back into that call, and
calls of other tools, with arguments off their schema, or without the markup do not match."""
from __future__ import annotations

import json
import re
import string

import outlines_core
import pytest
from hypothesis import given, settings, strategies as st

from kvrt.runtime.http.tool_calls import HERMES, LLAMA3_JSON, parse_tool_calls
from kvrt.runtime.grammar.tool_call import ToolSchemaError, forced_call_regex

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}, "exact": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["city", "unit", "days", "exact"]}
TOOLS = [("get_weather", WEATHER), ("now", None)]
VALID_WEATHER = st.fixed_dictionaries(
    {"city": st.text(st.characters(codec="ascii", categories=["L", "N", "P", "Zs"]), max_size=12),
     "unit": st.sampled_from(["c", "f"]), "days": st.integers(-10**6, 10**6), "exact": st.booleans()},
    optional={"tags": st.lists(st.text(string.ascii_letters, max_size=4), max_size=3)})
CHARS = {c: [i + 1] for i, c in enumerate(string.printable)}  # a vocabulary of one token per character


def _markup(fmt: str, name: str, args: dict, sep: tuple[str, str] = (", ", ": ")) -> str:
    """A call as the model writes it, its arguments in the schema's order (the order decoding keeps)."""
    order = list(WEATHER["properties"])
    args = dict(sorted(args.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    raw = json.dumps(args, separators=sep)
    if fmt == HERMES:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {raw}}}\n</tool_call>'
    return f'{{"name": "{name}", "parameters": {raw}}}'


def _walks(regex: str, text: str) -> bool:
    """Whether outlines_core's automaton for `regex` takes `text` to a final state."""
    guide = outlines_core.Guide(outlines_core.Index(regex, outlines_core.Vocabulary(0, CHARS)))
    ids = [CHARS[c][0] for c in text]
    if not guide.accepts_tokens(ids):
        return False
    for t in ids:
        guide.advance(t)
    return guide.is_finished()


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
@settings(max_examples=25, deadline=None)
@given(args=VALID_WEATHER, compact=st.booleans())
def test_valid_calls_match_and_parse_back(fmt, args, compact):
    regex = forced_call_regex(fmt, TOOLS)
    text = _markup(fmt, "get_weather", args, (",", ":") if compact else (", ", ": "))
    assert re.fullmatch(regex, text, re.S), text
    content, calls = parse_tool_calls(fmt, text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args)]
    assert re.fullmatch(regex, _markup(fmt, "now", {}))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
@settings(max_examples=25, deadline=None)
@given(args=VALID_WEATHER, bad=st.sampled_from(["name", "unit", "missing", "type", "extra", "markup"]))
def test_calls_off_the_tools_or_their_schema_do_not_match(fmt, args, bad):
    regex = forced_call_regex(fmt, TOOLS)
    name = "get_weather"
    if bad == "name":
        name = "get_wether"
    elif bad == "unit":
        args["unit"] = "k"
    elif bad == "missing":
        del args["days"]
    elif bad == "type":
        args["days"] = str(args["days"])
    elif bad == "extra":
        args["zzz"] = 1
    text = _markup(fmt, name, args)
    if bad == "markup":
        text = text[:-1]
    assert not re.fullmatch(regex, text, re.S), text


def test_the_automaton_of_guided_decoding_reads_the_regex_alike():
    for fmt in (HERMES, LLAMA3_JSON):
        regex = forced_call_regex(fmt, TOOLS)
        good = _markup(fmt, "get_weather", {"city": "Paris", "unit": "c", "days": 3, "exact": True, "tags": ["x"]})
        assert _walks(regex, good) and _walks(regex, _markup(fmt, "now", {}))
        assert not _walks(regex, _markup(fmt, "get_weather", {"city": "Paris", "unit": "k", "days": 3, "exact": True}))
        assert not _walks(regex, _markup(fmt, "other", {}))
    only = forced_call_regex(HERMES, [("now", None)])
    assert not re.fullmatch(only, _markup(HERMES, "get_weather", {"city": "", "unit": "c", "days": 0, "exact": False}))


def test_a_schema_that_cannot_be_decoded_under_is_named():
    with pytest.raises(ToolSchemaError, match="'f'"):
        forced_call_regex(HERMES, [("f", {"type": "no-such-type"})])
