"""What a node's HTTP API shares with vLLM's beyond the OpenAI routes, driven by the official
`openai` client against real launched checkpoints: model ids (the --model argument as given,
--served-model-name aliases, 404 model_not_found), /tokenize and /detokenize, /version, the
`vllm:` series on /metrics, and a checkpoint without a tokenizer, which serves token ids and
answers 400 to whatever needs text."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import openai
import pytest
from fastapi.testclient import TestClient

from kvrt.runtime.client.chat_template import ChatTemplate, Message
from kvrt.runtime.client.tokenizer import HFTokenizer
from kvrt.runtime.http.app import Server, create_app
from kvrt.runtime.http.server import served_model_names
from kvrt.ipc.ports import free_port
from tests.hfkit import greedy, make_checkpoint
from tests.launched import launched
from tests.runtime.http.test_http import _FakeBridge, _client, _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read().decode()


def _sample(text: str, name: str) -> float:
    """The value of the sample `name` (labels included, as exposed) in Prometheus text."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"no sample {name} in /metrics"
    return float(m.group(1))


def test_model_ids_are_named_as_vllm_names_them():
    assert served_model_names(None, "") == ["kvrt-reference"]
    assert served_model_names(None, "models/Qwen2.5-0.5B-Instruct/") == ["models/Qwen2.5-0.5B-Instruct/"]
    assert served_model_names(["a", "b", "a"], "/models/x") == ["a", "b"]


def test_an_unknown_model_is_a_404_model_not_found_and_an_alias_or_none_is_served():
    app = create_app(Server(_FakeBridge(True, "too_many_requests"), ["first", "second"]))
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"model": "nope", "prompt": [1, 2]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        for model in ("second", None):  # reaches the engine (whose fake answer is a 429: this client's quota)
            r = c.post("/v1/completions", json={"model": model, "prompt": [1, 2]})
            assert r.status_code == 429, r.text
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["first"]
        assert c.get("/version").json()["version"]
        assert c.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
        assert c.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]}) \
            .status_code == 400, "one of prompt and messages"
        assert c.post("/detokenize", json={"tokens": [1, 9999]}).json()["error"]["code"] == "invalid_token_id"
        text = c.get("/metrics").text
        assert "vllm:prompt_tokens_total" in text and "vllm:num_requests_running" not in text, \
            "without a node, only the API's own series"


@pytest.fixture
def qwen(tmp_path):
    directory = tmp_path / "qwen2"
    ck = make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320)
    make_tokenizer_dir(directory)
    return directory, ck


@pytest.mark.e2e
def test_aliases_tokenize_version_and_vllm_metrics_against_a_checkpoint(node, tmp_path, qwen):
    directory, _ = qwen
    tok = HFTokenizer.from_dir(str(directory))
    http = free_port()
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "64",
                  "--http-port", str(http), "--served-model-name", "tiny", "org/tiny-alias") as ln:
        _wait_healthy(http)
        oa = _client(http)
        models = oa.models.list().data
        assert [m.id for m in models] == ["tiny"] and models[0].model_extra["max_model_len"] > 0
        with pytest.raises(openai.NotFoundError) as e:
            oa.completions.create(model=str(directory), prompt="hi", max_tokens=2)
        assert e.value.body["code"] == "model_not_found", "with aliases, the path is not a name"
        before = _get(http, "/metrics")

        text = "What is a KV cache?"
        r = oa.completions.create(model="org/tiny-alias", prompt=text, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
        assert r.model == "tiny" and r.usage.completion_tokens == 5

        status, t = _post(http, "/tokenize", {"model": "tiny", "prompt": text})
        assert status == 200 and t["tokens"] == tok.encode(text) and t["count"] == r.usage.prompt_tokens
        assert t["max_model_len"] == models[0].model_extra["max_model_len"]
        assert _post(http, "/detokenize", {"model": "tiny", "tokens": t["tokens"]}) == (200, {"prompt": text})
        msgs = [{"role": "user", "content": text}]
        status, chat = _post(http, "/tokenize", {"messages": msgs})
        want = tok.encode(ChatTemplate(tok.chat_template, tok.special_tokens).render([Message("user", text)]),
                          add_special_tokens=False)
        assert status == 200 and chat["tokens"] == want
        c = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
        assert c.usage.prompt_tokens == chat["count"], "/tokenize counts what chat sends"
        assert json.loads(_get(http, "/version"))["version"]

        after = _get(http, "/metrics")
        label = '{model_name="tiny"}'
        moved = {n: _sample(after, n + label) - _sample(before, n + label)
                 for n in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                           "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                           "vllm:e2e_request_latency_seconds_count", "vllm:prefix_cache_queries_total")}
        assert moved["vllm:prompt_tokens_total"] == r.usage.prompt_tokens + c.usage.prompt_tokens
        assert moved["vllm:generation_tokens_total"] == 5 + c.usage.completion_tokens
        assert moved["vllm:time_to_first_token_seconds_count"] == 2
        assert moved["vllm:e2e_request_latency_seconds_count"] == 2
        assert moved["vllm:inter_token_latency_seconds_count"] > 0
        assert moved["vllm:prefix_cache_queries_total"] >= r.usage.prompt_tokens + c.usage.prompt_tokens
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_hits_total"):
            assert 0 <= _sample(after, name + label)
        assert ln.client.generate([1, 2, 3], 1).finish_reason == "length", "the node still serves"


@pytest.mark.e2e
def test_a_checkpoint_without_a_tokenizer_serves_token_ids_and_refuses_text(node, tmp_path, qwen):
    directory, ck = qwen
    (directory / "tokenizer.json").unlink()
    http = free_port()
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "64",
                  "--http-port", str(http)):
        _wait_healthy(http)
        oa = _client(http)
        model = str(directory)  # the --model argument, exactly as given
        assert [m.id for m in oa.models.list().data] == [model]
        prompt = [5, 17, 42, 9, 100, 3]
        r = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
        assert r.choices[0].token_ids == greedy(ck, prompt, 4) and r.choices[0].text == ""
        s = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
        assert [t for chunk in s for ch in chunk.choices for t in ch.token_ids] == greedy(ck, prompt, 4)
        for call in (lambda: oa.completions.create(model=model, prompt="hello", max_tokens=2),
                     lambda: oa.completions.create(model=model, prompt=prompt, max_tokens=2, stop=["x"]),
                     lambda: oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])):
            with pytest.raises(openai.BadRequestError, match="tokenizer.json") as e:
                call()
            assert e.value.body["code"] == "no_tokenizer"
        for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]}),
                           ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})):
            status, err = _post(http, path, body)
            assert status == 400 and "tokenizer.json" in err["error"]["message"], (path, err)
