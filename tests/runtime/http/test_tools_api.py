"""Tools and reasoning in the chat API (vLLM's shape): tools reach the chat template, calls in an
answer come back as `tool_calls` (streamed as deltas), a forced call asks the engine for a
guided answer, `--reasoning-parser qwen3` splits off `reasoning_content`, and what is malformed
is a 400 naming it. Answers here come from a scripted engine (a random model's text holds no
calls); the e2e tests drive a real node with the official `openai` client."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvrt.runtime.client.api import TokenEvent
from kvrt.runtime.client.client import Result, Sampling
from kvrt.runtime.client.tokenizer import HFTokenizer
from kvrt.runtime.http.app import Server, create_app
from kvrt.runtime.http.tool_calls import HERMES
from kvrt.runtime.grammar.tool_call import tool_call_spec
from kvrt.ipc.ports import free_port
from tests.hfkit import make_checkpoint
from tests.launched import launched
from tests.runtime.http.fake_bridge import FakeBridge
from tests.runtime.http.test_http import _client, _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
# `now` taking no other argument: its only call is `{}`. NOW's schema allows any object, and a forced
# call of it can be cut by max_tokens inside a random key (seed 9 wrote `{"RRRR...` for 60 tokens)
NOW_ONLY = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
USER = [{"role": "user", "content": "weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
# the end of Qwen3's template: enable_thinking False closes the thinking in the prompt
QWEN3_LIKE = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
              "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
              "{%- endif %}{%- endif %}")


class _Scripted(FakeBridge):
    """A bridge whose engine answers every request with the tokens of `answer`, then EOS."""

    def __init__(self, tok: HFTokenizer, answer: str) -> None:
        super().__init__(max_model_len=4096)
        self.ids = tok.encode(answer, add_special_tokens=False)
        self.submitted: list = []

    def submit(self, sub) -> None:
        self.submitted.append(sub)
        for i, t in enumerate(self.ids):
            self.put(sub, TokenEvent(sub.request_id, i, [t]))
        self.put(sub, Result(sub.request_id, np.array(self.ids, dtype=np.int32), "eos", len(sub.prompt)))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return HFTokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def _app(tok, answer: str = "", **parsers) -> tuple[TestClient, _Scripted]:
    bridge = _Scripted(tok, answer)
    server = Server(bridge, "m", **parsers)
    server._tokenizer = tok
    return TestClient(create_app(server), raise_server_exceptions=False), bridge


def _events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _joined(events: list[dict]) -> tuple[dict, str]:
    """A streamed answer joined as the openai client joins it, and its finish reason."""
    msg, calls, reason = {"content": "", "reasoning_content": ""}, {}, None
    for ev in events:
        for ch in ev["choices"]:
            d = ch["delta"]
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for c in d.get("tool_calls", []):
                if "id" in c:
                    calls[c["index"]] = {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                else:
                    calls[c["index"]]["arguments"] += c["function"]["arguments"]
            reason = ch["finish_reason"] or reason
    msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, reason


def test_an_answer_with_calls_comes_back_as_tool_calls_whole_and_streamed(tok):
    c, bridge = _app(tok, "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    body = {"messages": USER, "tools": [WEATHER, NOW]}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Let me look."
    assert [(t["type"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]] \
        == [("function", "get_weather", {"city": city, "unit": "c"}) for city in ("Paris", "Oslo")]
    assert all(t["id"].startswith("call_") for t in msg["tool_calls"]) and len({t["id"] for t in msg["tool_calls"]}) == 2
    assert bridge.submitted[0].sampling.guided is None, "auto forces nothing"

    events = _events(c.post("/v1/chat/completions", json={**body, "stream": True}))
    joined, reason = _joined(events)
    assert reason == "tool_calls" and joined["content"] == "Let me look."
    assert joined["tool_calls"] == [t["function"] for t in msg["tool_calls"]]
    assert not any("tool_call>" in (ch["delta"].get("content") or "") for ev in events for ch in ev["choices"])


def test_tool_choice_none_and_a_server_without_a_format_read_no_calls(tok):
    c, _ = _app(tok, CALL)
    for body in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        msg = c.post("/v1/chat/completions", json={"messages": USER, **body}).json()["choices"][0]["message"]
        assert msg["content"] == CALL and "tool_calls" not in msg, body
    c, _ = _app(tok, CALL, tool_call_parser="llama3_json")
    msg = c.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]}).json()["choices"][0]["message"]
    assert msg["content"] == CALL and msg["tool_calls"] == [], "--tool-call-parser wins over the template"


@pytest.mark.parametrize("choice,allowed", [("required", [WEATHER, NOW]),
                                            ({"type": "function", "function": {"name": "now"}}, [NOW])])
def test_a_forced_call_asks_the_engine_for_a_guided_answer(tok, choice, allowed):
    c, bridge = _app(tok, CALL)
    r = c.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER, NOW], "tool_choice": choice})
    assert r.status_code == 200, r.text
    want = tool_call_spec(HERMES, [(t["function"]["name"], t["function"]["parameters"]) for t in allowed])
    assert bridge.submitted[0].sampling.guided == {"kind": "tool_call", "spec": want}  # compiled by the node


def test_a_forced_call_after_a_prompt_that_opens_thinking_is_read_as_a_call(tok):
    opening = tok.__class__(**{**tok.__dict__, "chat_template": QWEN3_LIKE + "{{ '<think>\\n' }}"})
    c, _ = _app(opening, CALL, reasoning_parser="qwen3", tool_call_parser="hermes")
    for choice, calls in (("required", 1), ("auto", 0)):
        msg = c.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER], "tool_choice": choice}) \
            .json()["choices"][0]["message"]
        assert len(msg["tool_calls"]) == calls, (choice, msg)
        assert (msg["reasoning_content"] is None) == bool(calls), "unforced, the answer starts in the thinking"


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, None),
    ({"messages": [{"role": "user", "content": None}]}, None),
])
def test_malformed_tools_are_a_400_naming_them(tok, body, param):
    c, bridge = _app(tok, CALL)
    r = c.post("/v1/chat/completions", json={"messages": USER, **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()
    assert not bridge.submitted
    c, _ = _app(tok.__class__(**{**tok.__dict__, "chat_template": QWEN3_LIKE}), CALL)
    r = c.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"], "no format to read calls in"


def test_a_conversation_with_calls_and_their_results_is_rendered(tok):
    c, _ = _app(tok)
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = c.post("/tokenize", json={"messages": history, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    text = tok.decode(r.json()["tokens"], skip_special_tokens=False)
    assert CALL in text, "the call as the template writes it, arguments as JSON"
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text and json.dumps(WEATHER) in text
    plain = c.post("/tokenize", json={"messages": history}).json()
    assert plain["count"] < r.json()["count"] and json.dumps(WEATHER) not in tok.decode(plain["tokens"])


def test_reasoning_is_split_off_only_with_the_parser(tok):
    answer = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
    c, _ = _app(tok, answer, reasoning_parser="qwen3")
    msg = c.post("/v1/chat/completions", json={"messages": USER}).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "\nThe user wants weather.\n" and msg["content"] == "It is sunny."
    joined, reason = _joined(_events(c.post("/v1/chat/completions", json={"messages": USER, "stream": True})))
    assert (joined["reasoning_content"], joined["content"], reason) == (msg["reasoning_content"], msg["content"], "stop")
    c, _ = _app(tok, answer)
    msg = c.post("/v1/chat/completions", json={"messages": USER}).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": answer}, "without the flag nothing changes"


def test_chat_template_kwargs_reach_the_template(tok):
    qwen3 = tok.__class__(**{**tok.__dict__, "chat_template": QWEN3_LIKE})
    c, _ = _app(qwen3, "It is sunny.", reasoning_parser="qwen3")
    on = c.post("/tokenize", json={"messages": USER}).json()
    off = c.post("/tokenize", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert qwen3.decode(off["tokens"], skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert off["tokens"][:on["count"]] == on["tokens"] and off["count"] > on["count"]
    msg = c.post("/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}) \
        .json()["choices"][0]["message"]
    assert msg["content"] == "It is sunny." and msg["reasoning_content"] is None


@pytest.fixture
def qwen_http(node, tmp_path):
    directory = tmp_path / "qwen2"
    make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320,
                    max_position_embeddings=2048)  # the tools prompt is long in a tiny vocabulary
    make_tokenizer_dir(directory)
    http = free_port()
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "128",
                  "--http-port", str(http), "--reasoning-parser", "qwen3") as ln:
        _wait_healthy(http)
        yield ln, _client(http), http, HFTokenizer.from_dir(str(directory))


def _guided_engine(ln, tok: HFTokenizer) -> bool:
    """Whether the node's engine decodes under `Generation.guided`: a request forced to one
    string gives that string."""
    prompt = tok.encode("hello", add_special_tokens=False)
    res = ln.client.generate(prompt, 8, eos_token_id=tok.eos_token_ids[0],
                             sampling=Sampling(temperature=1.0, seed=1, guided={"kind": "regex", "spec": "world"}))
    return tok.decode([int(t) for t in res.output_token_ids]) == "world"


@pytest.mark.e2e
def test_tools_reach_the_template_and_forced_calls_are_valid_calls(qwen_http):
    ln, oa, http, tok = qwen_http

    def tokenize(body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{http}/tokenize", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    r = oa.chat.completions.create(model=oa.models.list().data[0].id, messages=USER, tools=[WEATHER, NOW],
                                   max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    with_tools, without = tokenize({"messages": USER, "tools": [WEATHER, NOW]}), tokenize({"messages": USER})
    assert r.usage.prompt_tokens == with_tools["count"] > without["count"], "the tools are in the prompt"
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls in (None, [])
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    s = oa.chat.completions.create(model=r.model, messages=history, tools=[NOW], max_tokens=3, stream=True)
    assert [ch for ch in s], "a history with calls and results is served"

    if not _guided_engine(ln, tok):
        pytest.skip("the engine does not decode under Generation.guided yet (the guided-decoding branch adds it)")
    for seed in range(4):
        r = oa.chat.completions.create(model=r.model, messages=USER, tools=[WEATHER, NOW_ONLY], tool_choice="required",
                                       max_tokens=120, temperature=1.0, seed=seed, n=4)
        for ch in r.choices:
            calls = ch.message.tool_calls
            assert ch.finish_reason == "tool_calls" and len(calls) == 1, (seed, ch)
            args = json.loads(calls[0].function.arguments)
            assert calls[0].function.name in ("get_weather", "now")
            if calls[0].function.name == "get_weather":
                assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
            else:
                assert args == {}
    named = oa.chat.completions.create(model=r.model, messages=USER, tools=[WEATHER, NOW_ONLY], max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "now"}}, stream=True)
    text = "".join(d.function.arguments or "" for chunk in named for c in chunk.choices
                   for d in c.delta.tool_calls or [])
    assert json.loads(text) == {}
