"""Text work on a real node serving a checkpoint (a real tokenizer, a chat template), as attackers
and the openai client send it: what no model of its length could take is refused with a 400
naming the limit before any tokenizing (/tokenize of 4.6 MB, a prompt of that text, /detokenize
of a million ids, a conversation of 100,000 messages); a chat template that loops for ever is a
400 naming its time limit, and another client is answered meanwhile (it renders in a worker
thread, not on the event loop); a refusal of the request is never a 5xx: an assistant turn with
`"content": null` and tool calls (what the openai client sends back) renders as "" as vLLM renders
it, a template that fails on the conversation and text that is not Unicode are 400s."""
from __future__ import annotations

import concurrent.futures
import json

import httpx2
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.chat_template import RENDER_S
from tests.hfkit import make_checkpoint
from tests.launched import launched
from tests.runtime.http.test_http import _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir

pytestmark = pytest.mark.e2e

# Qwen3's way with an assistant turn ('</think>' in its content), a conversation that makes the
# template loop for ever ("loop") and one it fails on ("fail": a string plus a number)
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{%- set content = m.content %}"
    "{%- if '</think>' in m.content %}{%- set content = m.content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for c in m.tool_calls or [] %}{{- '\\n<tool_call>' + c.function.name + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if messages[-1].content == 'loop' %}{%- for i in range(100000) %}{%- for j in range(100000) %}"
    "{%- endfor %}{%- endfor %}{%- endif %}"
    "{%- if messages[-1].content == 'fail' %}{{- messages[-1].content + 1 }}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
USER = {"role": "user", "content": "hello world"}


@pytest.fixture
def served(node, tmp_path):
    directory = tmp_path / "ck"
    make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320,
                    max_position_embeddings=4096)
    make_tokenizer_dir(directory, chat_template=TEMPLATE)
    http = free_port()
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "128",
                  "--http-port", str(http)) as ln:
        _wait_healthy(http)
        with httpx2.Client(base_url=f"http://127.0.0.1:{http}", timeout=60) as c:
            yield ln, c
        assert ln.proc.poll() is None, ln.logs()


def _error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text[:300]
    return r.json()["error"]


def test_text_no_model_of_this_length_takes_is_refused_before_it_is_tokenized(served):
    _, c = served
    text = "hello world " * (4_600_000 // 12)
    for path, body, field in [("/tokenize", {"prompt": text}, "prompt"),
                              ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
                              ("/v1/completions", {"prompt": ["a", text], "max_tokens": 1}, "prompt"),
                              ("/detokenize", {"tokens": [5] * 1_000_000}, "tokens"),
                              ("/v1/chat/completions", {"messages": [USER] * 100_000, "max_tokens": 1}, "messages"),
                              ("/tokenize", {"messages": [{"role": "user", "content": text}]}, "messages")]:
        err = _error(c.post(path, json=body))
        assert err["param"] == field and err["code"] == "context_length_exceeded", (path, err)
        assert "4096" in err["message"], err  # the model's length, which the limit follows from
    ok = c.post("/tokenize", json={"prompt": "hello world"}).json()
    assert ok["count"] > 0 and c.post("/detokenize", json={"tokens": ok["tokens"]}).json()["prompt"] == "hello world"


@pytest.mark.alone  # the others must be answered within the template's time limit
def test_a_template_that_loops_for_ever_is_refused_while_others_are_served(served):
    _, c = served
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        looping = pool.submit(c.post, "/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "loop"}], "max_tokens": 1})
        served_meanwhile = 0
        while not looping.done():
            r = c.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 2})
            assert r.status_code == 200, r.text[:300]
            served_meanwhile += not looping.done()
        err = _error(looping.result())
    assert err["param"] == "messages" and f"{RENDER_S:g} s" in err["message"], err
    assert served_meanwhile, "no other request was answered while the template looped"


def test_a_refusal_of_the_request_is_a_4xx(served):
    _, c = served
    called = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    r = c.post("/v1/chat/completions", json={"messages": called, "max_tokens": 2})
    assert r.status_code == 200, r.text[:300]
    rendered = c.post("/tokenize", json={"messages": called}).json()["tokens"]
    same = c.post("/tokenize", json={"messages": [called[0], {**called[1], "content": ""}, called[2]]}).json()
    assert rendered == same["tokens"], "a null content renders as an empty one"
    err = _error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "fail"}]}))
    assert err["param"] == "messages" and "TypeError" in err["message"], err
    lone = '{"prompt": "a\\ud800b", "max_tokens": 1}'
    for path, raw in [("/v1/completions", lone), ("/tokenize", lone),
                      ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
                      ("/v1/completions", "[" * 100_000), ("/v1/completions", "{"), ("/tokenize", "not json")]:
        r = c.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, raw[:40], r.status_code, r.text[:300])
        assert json.loads(r.text)["error"]["message"]
