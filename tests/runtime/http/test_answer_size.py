"""The log-probabilities an answer may carry (runtime/http/answer_size.py), against answers a node's
app really writes (over a scripted engine that scores every prompt position and output token
with every alternative asked): the estimate is never below what an answer carries, equal when
the answers run to max_tokens, streamed or not; an answer past the limit is refused before any
request is sent, and a large one comes written as it is made, the same JSON."""
from __future__ import annotations

import json

import numpy as np
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.runtime.client.api import TokenEvent
from kvrt.runtime.client.client import Result
from kvrt.runtime.client.tokenizer import ByteTokenizer
from kvrt.runtime.http.answer_size import BIG_ANSWER, answer_entries, max_answer_entries
from kvrt.runtime.http.app import Server, create_app
from tests.runtime.http.fake_bridge import FakeBridge

MODEL = "m"
LEN = 1024  # (64 choices of a prompt this long with 20 alternatives pass the limit)


class _Scoring(FakeBridge):
    """A bridge whose engine answers each request with `max_tokens` tokens, each with `top`
    alternatives, and scores its prompt with its `prompt_logprobs` alternatives."""

    def __init__(self) -> None:
        super().__init__(vocab_size=256, max_model_len=LEN)
        self.submitted: list = []

    def submit(self, sub) -> None:
        self.submitted.append(sub)
        s, n = sub.sampling, sub.max_tokens
        k = s.top_logprobs if s.logprobs else 0
        alts = [[list(range(k)), [-1.0 - j for j in range(k)]] for _ in range(n)]
        ev = TokenEvent(sub.request_id, 0, list(range(65, 65 + n)), [-0.5] * n if s.logprobs else [], alts if k else [])
        if s.prompt_logprobs is not None:
            pk = s.prompt_logprobs
            m = len(sub.prompt) - 1
            ev.prompt_logprobs, ev.prompt_ranks = [-2.0] * m, [3] * m
            ev.prompt_top = [[list(range(100, 100 + pk)), [-1.5] * pk] for _ in range(m)] if pk else []
        self.put(sub, ev)
        self.put(sub, Result(sub.request_id, np.arange(65, 65 + n, dtype=np.int32), "length", len(sub.prompt)))


def _app() -> tuple[TestClient, _Scoring]:
    bridge = _Scoring()
    server = Server(bridge, MODEL)
    server._tokenizer = ByteTokenizer()
    return TestClient(create_app(server), raise_server_exceptions=False), bridge


def _carried(answer: dict) -> int:
    """The log-probability entries an answer (or a stream's events, joined) carries."""
    total = 0
    for ch in answer.get("choices", []):
        lp = ch.get("logprobs")
        if lp and "tokens" in lp:
            total += len(lp["tokens"]) + sum(len(t) for t in lp["top_logprobs"] or [] if t)
        elif lp and "content" in lp:
            total += sum(1 + len(e["top_logprobs"]) for e in lp["content"])
        total += sum(len(p) for p in ch.get("prompt_logprobs") or [] if p)
    total += sum(len(p) for p in answer.get("prompt_logprobs") or [] if p)
    return total


@settings(max_examples=60, deadline=None)
@given(prompts=st.integers(1, 3), plen=st.integers(2, 40), n=st.integers(1, 3), max_tokens=st.integers(1, 20),
       prompt_k=st.one_of(st.none(), st.integers(0, 20)), k=st.one_of(st.none(), st.integers(0, 20)),
       echo=st.booleans(), stream=st.booleans())
def test_the_estimate_is_never_below_what_an_answer_carries(prompts, plen, n, max_tokens, prompt_k, k, echo, stream):
    c, _ = _app()
    ids = [[(7 * i + j) % 200 + 32 for j in range(plen)] for i in range(prompts)]
    body = {"model": MODEL, "prompt": ids, "n": n, "max_tokens": max_tokens, "prompt_logprobs": prompt_k,
            "logprobs": k, "echo": echo, "stream": stream}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        carried = sum(_carried(json.loads(x[6:])) for x in r.text.split("\n\n") if x.startswith("data: {"))
    else:
        carried = _carried(r.json())
    want = answer_entries([plen] * prompts, n, max_tokens, prompt_k, k, k if echo else None)
    assert carried <= want
    if k is not None and prompt_k is None and not echo:  # (no prompt entries, whose tokens may repeat alternatives)
        assert carried == want


def test_past_the_limit_nothing_is_sent_and_a_large_answer_is_written_as_made():
    c, bridge = _app()
    plen = LEN - 1
    assert answer_entries([plen] * 16, 4, 1, 20, None) > max_answer_entries(LEN)
    over = {"model": MODEL, "prompt": [[65] * plen] * 16, "n": 4, "max_tokens": 1, "prompt_logprobs": 20}
    r = c.post("/v1/completions", json=over)
    assert r.status_code == 400 and r.json()["error"]["code"] == "answer_too_large", r.text[:300]
    assert not bridge.submitted
    big = {"model": MODEL, "prompt": [65] * plen, "max_tokens": 1, "prompt_logprobs": 20}
    assert answer_entries([plen], 1, 1, 20, None) > BIG_ANSWER
    r = c.post("/v1/completions", json=big)
    assert r.status_code == 200 and "content-length" not in r.headers
    assert len(r.json()["choices"][0]["prompt_logprobs"]) == plen
