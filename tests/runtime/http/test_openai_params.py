"""The OpenAI request surface beyond plain sampling, driven by the real `openai` client against
a launched node serving a real tiny checkpoint with its tokenizer: logprobs with alternatives
(against a float64 reference's log-softmax), penalties and logit bias (against the reference
with the same adjustments), min_tokens, stop token ids, n choices, echo, lists of prompts; and
every field kvrt does not implement refused by name (a unit test over a fake bridge)."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.tokenizer import HFTokenizer
from kvrt.runtime.http.app import Server, create_app
from tests.hfkit import dense_logits, make_checkpoint
from tests.launched import launched
from tests.runtime.http.test_http import MODEL, _client, _FakeBridge, _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir


@pytest.fixture
def served(node, tmp_path):
    directory = tmp_path / "qwen2"
    ck = make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320)
    make_tokenizer_dir(directory)
    http = free_port()
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "128",
                  "--http-port", str(http)) as ln:
        _wait_healthy(http)
        yield ck, HFTokenizer.from_dir(str(directory)), _client(http), str(directory), ln


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def _reference(ck, prompt: list[int], new: int, rep: float = 1.0, freq: float = 0.0, pres: float = 0.0,
               bias: dict | None = None) -> list[int]:
    """Greedy tokens of the dense reference under a logit bias, then HF's repetition penalty and
    OpenAI's frequency and presence penalties, in float64."""
    seq, out = list(prompt), []
    for _ in range(new):
        z = dense_logits(ck, seq)[-1].astype(np.float64)
        for t, b in (bias or {}).items():
            z[t] += b
        for t in set(seq):
            z[t] = z[t] / rep if z[t] > 0 else z[t] * rep
        for t in set(out):
            z[t] -= freq * out.count(t) + pres
        out.append(int(z.argmax()))
        seq.append(out[-1])
    return out


@pytest.mark.e2e
def test_logprobs_penalties_bias_min_tokens_and_stop_ids(served):
    ck, tok, oa, model, _ = served
    prompt = tok.encode("The cache holds keys and values")
    # top logprobs: the reference's log-softmax at each position, most likely first
    r = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=5, extra_body={"ignore_eos": True})
    out = r.choices[0].model_extra["token_ids"]
    lp = r.choices[0].logprobs
    for i, t in enumerate(out):
        ref = _log_softmax(dense_logits(ck, prompt + out[:i])[-1].astype(np.float64))
        assert abs(lp.token_logprobs[i] - ref[t]) < 2e-3
        top5 = np.sort(ref)[::-1][:5]
        got = list(lp.top_logprobs[i].values())  # keyed by text: alternatives that decode alike share one
        assert 1 <= len(got) <= 5 and all(np.abs(top5 - v).min() < 2e-3 for v in got)
        assert abs(max(got) - top5[0]) < 2e-3
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    s = oa.chat.completions.create(model=model, messages=messages, max_completion_tokens=3, temperature=0,
                                   logprobs=True, top_logprobs=3, stream=True, stream_options={"include_usage": True},
                                   extra_body={"ignore_eos": True})
    chunks = list(s)
    content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    ask = urllib.request.Request(str(oa.base_url).removesuffix("v1/") + "tokenize", method="POST",
                                 data=json.dumps({"messages": messages}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=30) as answer:
        chat_prompt = json.loads(answer.read())["tokens"]
    seq = list(chat_prompt)
    assert len(content) == 3
    for c in content:  # a list per position: every alternative, in order
        ref = _log_softmax(dense_logits(ck, seq)[-1].astype(np.float64))
        want = np.lexsort((np.arange(len(ref)), -ref))[:3]
        assert [a.token for a in c.top_logprobs] == [tok.decode([int(t)]) for t in want]
        np.testing.assert_allclose([a.logprob for a in c.top_logprobs], ref[want], atol=2e-3)
        seq.append(int(want[0]))  # greedy: the likeliest is the one chosen
    assert chunks[-1].usage.completion_tokens == 3
    system = oa.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Hi"}],
                                        max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert system.usage.prompt_tokens == chunks[-1].usage.prompt_tokens, "developer reads as system"
    # penalties and logit bias: the reference's greedy tokens under the same adjustments
    bias = {int(out[0]): -100.0, 7: 3.0}
    kw = dict(rep=1.3, freq=0.7, pres=0.4, bias=bias)
    want = _reference(ck, prompt, 6, **kw)
    got = oa.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logit_bias=bias,
                                frequency_penalty=0.7, presence_penalty=0.4,
                                extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert got.choices[0].model_extra["token_ids"] == want
    assert want != _reference(ck, prompt, 6), "the adjustments change the answer"
    # min_tokens: EOS (made the likeliest) cannot come before it; stop token ids end the answer
    eos = tok.eos_token_ids[0]
    first = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={eos: 100})
    assert first.choices[0].model_extra["token_ids"] == [eos] and first.choices[0].finish_reason == "stop"
    late = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={eos: 100},
                                 extra_body={"min_tokens": 3})
    ids = late.choices[0].model_extra["token_ids"]
    assert len(ids) == 4 and ids[-1] == eos and eos not in ids[:3] and late.choices[0].finish_reason == "stop"
    x = tok.encode("a")[0]
    for include in (False, True):
        stop = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={x: 100},
                                     extra_body={"stop_token_ids": [x], "include_stop_str_in_output": include})
        assert stop.choices[0].model_extra["token_ids"] == [x] and stop.choices[0].finish_reason == "stop"
        assert stop.choices[0].text == ("a" if include else "")
    special = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={eos: 100},
                                    extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True})
    assert special.choices[0].text == "<|im_end|>"


@pytest.mark.e2e
def test_n_choices_echo_and_prompt_lists(served):
    ck, tok, oa, model, ln = served
    prompt = tok.encode("Blocks of the prompt are shared by every choice of the request")
    assert len(prompt) >= 16
    r = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=1.0, seed=7, n=3,
                              extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(prompt), "a prompt counts once"
    full = len(prompt) // 8 * 8
    # the first choice computes the prompt; the others find its full blocks cached
    assert r.usage.prompt_tokens_details.cached_tokens >= 2 * (full - 8)
    for j, c in enumerate(r.choices):  # choice j samples as a request of its own with seed 7 + j
        alone = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=1.0, seed=7 + j,
                                      extra_body={"ignore_eos": True})
        assert alone.choices[0].model_extra["token_ids"] == c.model_extra["token_ids"]
    s = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=1.0, seed=7, n=3, stream=True,
                              extra_body={"ignore_eos": True})
    texts = {}
    for ch in s:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in r.choices}
    e = oa.completions.create(model=model, prompt=["one two", "three"], max_tokens=2, temperature=0, n=2, echo=True,
                              extra_body={"ignore_eos": True})
    assert [c.index for c in e.choices] == [0, 1, 2, 3]
    assert [c.text[:7] for c in e.choices[:2]] == ["one two"] * 2 and e.choices[2].text.startswith("three")
    assert e.choices[0].text == e.choices[1].text, "greedy choices agree"


def _prompt_reference(ck, prompt: list[int]) -> np.ndarray:
    """The float64 log-softmax of the dense reference's logits at every prompt position but the last."""
    z = dense_logits(ck, prompt)[:-1].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.e2e
def test_prompt_logprobs_echo_and_stop_reason(served):
    ck, tok, oa, model, ln = served
    prompt = tok.encode("Every prompt token is scored given the tokens before it, whatever its chunk")
    ref = _prompt_reference(ck, prompt)
    at = np.arange(len(prompt) - 1)
    want_lp = ref[at, prompt[1:]]
    # echo with logprobs: the prompt's tokens first (the first with null), then the answer's
    r = oa.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2,
                              extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    out = r.choices[0].model_extra["token_ids"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(prompt) + 1
    assert lp.tokens[:len(prompt)] == [tok.decode([t]) for t in prompt]
    np.testing.assert_allclose(lp.token_logprobs[1:len(prompt)], want_lp, rtol=0, atol=2e-3)
    for i in range(1, len(prompt)):
        top2 = np.sort(ref[i - 1])[::-1][:2]
        assert all(np.abs(top2 - v).min() < 2e-3 for v in lp.top_logprobs[i].values())
    assert r.choices[0].text.startswith(tok.decode(prompt))
    assert r.choices[0].model_extra["prompt_logprobs"] is None, "not asked"
    # vLLM's prompt_logprobs, with a prefix the cache holds (it is computed all the same) and n
    k = 3
    v = oa.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, n=2,
                              extra_body={"prompt_logprobs": k, "ignore_eos": True})
    for c in v.choices:
        pl = c.model_extra["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(prompt)
        for i, entry in enumerate(pl[1:]):
            mine = entry[str(prompt[i + 1])]
            assert abs(mine["logprob"] - want_lp[i]) < 2e-3 and mine["decoded_token"] == tok.decode([prompt[i + 1]])
            assert abs(mine["rank"] - (1 + (ref[i] > want_lp[i]).sum())) <= 1  # (float32 near-ties)
            best = np.lexsort((np.arange(ref.shape[1]), -ref[i]))[:k]
            assert {str(int(t)) for t in best} <= set(entry) and len(entry) in (k, k + 1)
            assert [entry[str(int(t))]["rank"] for t in best] == [1, 2, 3] or mine["rank"] <= k
    assert v.choices[0].model_extra["prompt_logprobs"] == v.choices[1].model_extra["prompt_logprobs"]
    assert r.choices[0].logprobs.token_logprobs[1:len(prompt)] == [
        v.choices[0].model_extra["prompt_logprobs"][i + 1][str(prompt[i + 1])]["logprob"] for i in range(len(prompt) - 1)]
    # streamed: the first chunk of each choice carries them; echo with logprobs streams too
    s = list(oa.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True, echo=True,
                                   logprobs=1, extra_body={"prompt_logprobs": k, "ignore_eos": True}))
    assert s[0].choices[0].model_extra["prompt_logprobs"] == v.choices[0].model_extra["prompt_logprobs"]
    assert all(ch.choices[0].model_extra["prompt_logprobs"] is None for ch in s[1:])
    assert [t for ch in s for t in ch.choices[0].logprobs.token_logprobs][:len(prompt)] == \
        r.choices[0].logprobs.token_logprobs[:len(prompt)]
    messages = [{"role": "user", "content": "Hi"}]
    chat = oa.chat.completions.create(model=model, messages=messages, max_completion_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 0})
    pl = chat.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == chat.usage.prompt_tokens and all(len(e) == 1 for e in pl[1:])
    chunks = list(oa.chat.completions.create(model=model, messages=messages, max_completion_tokens=1, temperature=0,
                                             stream=True, extra_body={"prompt_logprobs": 0}))
    assert [ch.model_extra.get("prompt_logprobs") for ch in chunks][:2] == [None, pl]
    assert all(ch.model_extra.get("prompt_logprobs") is None for ch in chunks[2:])
    # stop_reason: the stop string or stop token id that ended a choice; null for EOS and length
    x = tok.encode("a")[0]
    by_string = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={x: 100},
                                      stop=["a"])
    by_id = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={x: 100},
                                  extra_body={"stop_token_ids": [x]})
    eos = tok.eos_token_ids[0]
    by_eos = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={eos: 100})
    by_length = oa.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.choices[0].model_extra["stop_reason"] for c in (by_string, by_id, by_eos, by_length)] == ["a", x, None,
                                                                                                     None]
    assert [c.choices[0].finish_reason for c in (by_string, by_id, by_eos, by_length)] == ["stop"] * 3 + ["length"]
    shown = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={x: 100},
                                  stop=["a"], extra_body={"include_stop_str_in_output": True})
    assert (by_string.choices[0].text, shown.choices[0].text, shown.choices[0].model_extra["stop_reason"]) == \
        ("", "a", "a")
    streamed = list(oa.chat.completions.create(model=model, messages=messages, max_completion_tokens=8, temperature=0,
                                               logit_bias={x: 100}, stop="a", stream=True))
    assert streamed[-1].choices[0].model_extra["stop_reason"] == "a"
    assert all(ch.choices[0].model_extra["stop_reason"] is None for ch in streamed[:-1])
    plain = oa.chat.completions.create(model=model, messages=messages, max_completion_tokens=8, temperature=0,
                                       logit_bias={x: 100}, extra_body={"stop_token_ids": [x]})
    assert plain.choices[0].model_extra["stop_reason"] == x and plain.model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"suffix": "x"}, "suffix"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"n": 17}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logit_bias": {"5": 101}}, None),
    ({"logit_bias": {"512": 1}}, "logit_bias"),
    ({"stop_token_ids": [600]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stream_options": {"include_usage": True, "every_chunk": True}, "stream": True}, "stream_options.every_chunk"),
])
def test_what_kvrt_does_not_implement_is_refused_by_name(body, param):
    with TestClient(create_app(Server(_FakeBridge(True), MODEL)), raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        if param is not None:
            assert r.json()["error"]["param"] == param, r.json()


def test_chat_refusals_and_what_asks_nothing_is_accepted():
    with TestClient(create_app(Server(_FakeBridge(True), MODEL)), raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
        assert r.status_code == 400 and "top_logprobs" in r.text
        # null fields, an end-user id, tool_choice "none" and a text response ask nothing: the
        # fake engine's 503 shows the request got through
        for extra in ({"user": "u"}, {"foo": None}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
                      {"tools": []}):
            r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, **extra})
            assert r.status_code == 503, (extra, r.text)


def test_sglang_router_defaults_ask_nothing_but_their_other_values_are_refused():
    """SGLang's router adds no_stop_trim/return_hidden_states at their off values to every body."""
    from kvrt.runtime.http.openai_schema import CompletionRequest

    off = CompletionRequest(prompt="a", no_stop_trim=False, return_hidden_states=False, user="u")
    assert off.unsupported() is None
    assert CompletionRequest(prompt="a", no_stop_trim=True).unsupported() == "no_stop_trim"
    assert CompletionRequest(prompt="a", return_hidden_states=True).unsupported() == "return_hidden_states"
    assert CompletionRequest(prompt="a", no_stop_trim=0).unsupported() == "no_stop_trim"
