"""The tool-call and reasoning parsers on text alone (runtime/http/tool_calls.py, reasoning.py,
chat_output.py): a whole answer gives the calls it holds, and the same text streamed in pieces
cut anywhere gives deltas that join into exactly that message, with no markup in the content."""
from __future__ import annotations

import itertools
import json

from hypothesis import given, settings, strategies as st

from kvrt.runtime.http.chat_output import ChatOutput
from kvrt.runtime.http.openai_schema import TOOL_NAME
from kvrt.runtime.http.reasoning import ReasoningParser, prompt_opens_thinking
from kvrt.runtime.http.tool_calls import (HERMES, LLAMA3_JSON, default_parser, parse_tool_calls)
from tests.tokenizer_kit import QWEN25_TEMPLATE

NAMES = st.from_regex(TOOL_NAME, fullmatch=True)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8)
                    | st.floats(allow_nan=False, allow_infinity=False),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
ARGS = st.dictionaries(st.text(max_size=6), JSON, max_size=4)
WS = st.sampled_from(["", "\n", " ", "\n\n"])
# content: no markup, no whitespace at its ends (whitespace next to a call is markup)
CONTENT = st.text(st.characters(codec="utf-8", exclude_characters="<"), min_size=1, max_size=20) \
    .map(str.strip).filter(bool)


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


def _streamed(out: ChatOutput, pieces: list[str]) -> tuple[dict, list[dict]]:
    """The message a client joins from the deltas of `pieces`, and the deltas."""
    deltas = [d for p in pieces for d in out.feed(p)] + out.finish()
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in msg["tool_calls"] and c["type"] == "function" and c["function"]["name"]
                msg["tool_calls"][c["index"]] = {"id": c["id"], "type": "function", "function": dict(c["function"])}
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                msg["tool_calls"][c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    return msg, deltas


def _same(streamed: dict, whole: dict) -> None:
    assert streamed["content"] == (whole["content"] or "")
    assert streamed["reasoning_content"] == (whole.get("reasoning_content") or "")
    calls = [streamed["tool_calls"][i] for i in sorted(streamed["tool_calls"])]
    assert calls == whole.get("tool_calls", [])


@st.composite
def hermes_answers(draw):
    """An answer of content and calls, and what parsing it must give."""
    text, content, calls = [], [], []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            c = draw(CONTENT)
            text.append(c)
            content.append(c)
        else:
            name, args = draw(NAMES), draw(ARGS)
            raw = json.dumps(args, ensure_ascii=draw(st.booleans()))
            text.append(draw(WS) + f'<tool_call>{draw(WS)}{{"name": {json.dumps(name)}, "arguments": {raw}}}'
                        f'{draw(WS)}</tool_call>' + draw(WS))
            calls.append((name, raw))
    return "".join(text), "".join(content), calls


@st.composite
def llama_answers(draw):
    calls = [(draw(NAMES), json.dumps(draw(ARGS))) for _ in range(draw(st.integers(1, 3)))]
    key = draw(st.sampled_from(["parameters", "arguments"]))
    tag = draw(st.sampled_from(["", "<|python_tag|>"]))
    body = draw(st.sampled_from(["; ", ";", " ; "])).join(f'{{"name": {json.dumps(n)}, "{key}": {a}}}' for n, a in calls)
    tail = draw(st.none() | CONTENT.filter(lambda c: c[0] not in ";{"))
    return draw(WS) + tag + body + ("" if tail is None else " " + tail), tail or "", calls


# texts with markup cut short, misplaced or malformed, for the split-invariance property
FRAGMENTS = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "<think>", "</think>", "<|python_tag|>", "{",
                             "}", '"', "\\", '{"name": ', '"f"', ', "arguments": ', ', "parameters": ', "[", "]",
                             ";", " ", "\n", "x", "é", '{"a": "}"}', "<tool_call>\n{\"name\": \"g\", \"arguments\": "])
MESSY = st.lists(FRAGMENTS, max_size=24).map("".join)


@settings(max_examples=60, deadline=None)
@given(hermes_answers())
def test_hermes_calls_and_content_are_read_whole(answer):
    text, content, calls = answer
    got_content, got = parse_tool_calls(HERMES, text, _ids())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(isinstance(json.loads(c.arguments), dict) for c in got)


@settings(max_examples=50, deadline=None)
@given(llama_answers())
def test_llama3_json_calls_are_read_whole(answer):
    text, content, calls = answer
    got_content, got = parse_tool_calls(LLAMA3_JSON, text, _ids())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([HERMES, LLAMA3_JSON]), st.booleans(), st.booleans(),
       st.one_of(hermes_answers().map(lambda a: a[0]), llama_answers().map(lambda a: a[0]), MESSY),
       st.lists(st.integers(0, 10_000), max_size=12))
def test_deltas_cut_anywhere_join_into_the_whole_message(fmt, reasoning, thinking, text, cuts):
    """The property a streaming client relies on: the deltas of any cut of the text join into
    the message the whole text gives, ids aside from which call is which."""
    if reasoning and thinking:
        text = "<think>" + text if len(text) % 2 else text + "</think>" + text
    whole = ChatOutput(fmt, reasoning, False, _ids()).message(text)
    streamed, deltas = _streamed(ChatOutput(fmt, reasoning, False, _ids()), _split(text, cuts))
    _same(streamed, whole)
    if whole["tool_calls"]:
        assert all("<tool_call>" not in d.get("content", "") for d in deltas) or "<tool_call>" in whole["content"]


@settings(max_examples=50, deadline=None)
@given(hermes_answers(), st.lists(st.integers(0, 10_000), max_size=30))
def test_streamed_calls_never_leak_markup_into_content(answer, cuts):
    text, content, calls = answer
    streamed, deltas = _streamed(ChatOutput(HERMES, new_id=_ids()), _split(text, cuts))
    assert streamed["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in (streamed["tool_calls"][i] for i in sorted(streamed["tool_calls"]))] == calls
    for d in deltas:
        assert "tool_call>" not in d.get("content", "") and '"arguments"' not in d.get("content", "")


def test_malformed_or_cut_calls_stay_content():
    for text in ("<tool_call>not json</tool_call>", "<tool_call>\n{\"name\": 3}", "a <tool_call>", "<tool_call>\n{",
                 '<tool_call>{"arguments": {}, "name": "f"}</tool_call>', '<tool_call>{"name": "", "arguments": {}}'):
        assert parse_tool_calls(HERMES, text) == (text, []), text
    for text in ("hello", 'I will call {"name": "f", "parameters": {}}', '{"name": "f", "parameters": 3}', " {"):
        assert parse_tool_calls(LLAMA3_JSON, text) == (text, []), text


def test_a_call_cut_by_the_length_limit_keeps_what_was_written():
    content, calls = parse_tool_calls(HERMES, 'ok <tool_call>\n{"name": "f", "arguments": {"a": [1, 2')
    assert content == "ok" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": [1, 2')]


def test_the_message_shape_with_and_without_calls():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    msg = ChatOutput(HERMES, new_id=_ids()).message(text)
    assert msg == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert ChatOutput(HERMES).message("hi") == {"role": "assistant", "content": "hi", "tool_calls": []}
    assert ChatOutput().message(text) == {"role": "assistant", "content": text}, "no parser: the text as it is"


def test_the_default_format_comes_from_the_chat_template():
    assert default_parser(QWEN25_TEMPLATE) == HERMES
    assert default_parser("{{ '<|python_tag|>' }}") == LLAMA3_JSON
    assert default_parser("{{ messages }}") is None and default_parser(None) is None


def test_reasoning_is_split_from_the_answer():
    def whole(text, inside=False):
        return ChatOutput(reasoning=True, in_reasoning=inside).message(text)

    assert whole("<think>\nhmm\n</think>\n\nHello") == {"role": "assistant", "content": "Hello",
                                                        "reasoning_content": "\nhmm\n"}
    assert whole("Hello <think>x</think>")["reasoning_content"] is None, "a late <think> is content"
    assert whole("still thinking")["content"] == "still thinking"
    assert whole("still thinking", inside=True) == {"role": "assistant", "content": "",
                                                    "reasoning_content": "still thinking"}
    assert whole("a</think>b", inside=True)["content"] == "b"
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    both = ChatOutput(HERMES, reasoning=True, new_id=_ids()).message(
        '<think>call <tool_call>?</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert both["reasoning_content"] == "call <tool_call>?" and both["tool_calls"][0]["function"]["name"] == "f"


@settings(max_examples=50, deadline=None)
@given(st.booleans(), st.lists(st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</", "\n", " ", "ab"]),
                               max_size=12).map("".join), st.lists(st.integers(0, 1000), max_size=8))
def test_reasoning_deltas_cut_anywhere_join_into_the_whole(inside, text, cuts):
    p = ReasoningParser(inside)
    whole = p.feed(text) + p.finish()
    p = ReasoningParser(inside)
    parts = [x for piece in _split(text, cuts) for x in p.feed(piece)] + p.finish()
    for kind in (True, False):
        assert "".join(t for r, t in parts if r == kind) == "".join(t for r, t in whole if r == kind)
