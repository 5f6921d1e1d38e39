"""Answers bounded and written as they are made, on a real node and through a real `kvrt route`:
four prompts of 4,000 tokens with n 16 and prompt_logprobs 20 (350 MiB of JSON, built whole,
once) is a 400 naming the limit before anything runs; an answer with thousands of
log-probabilities comes chunked (no Content-Length: written as made, runtime/http/json_stream.py)
and holds exactly the engine's scores (the ZeroMQ client's, an oracle the HTTP layer does not
share); the router passes it on as it comes, chunked too, byte for byte."""
from __future__ import annotations

import httpx2
import numpy as np
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.client import Sampling
from kvrt.runtime.client.tokenizer import ByteTokenizer
from kvrt.runtime.http.answer_size import MAX_ENTRIES
from tests.launched import SMALL, launched
from tests.runtime.http.test_http import MODEL, _wait_healthy
from tests.runtime.router.test_router import routing

pytestmark = pytest.mark.e2e

K = 5  # alternatives per prompt position


def _scores(ln, prompt: list[int]) -> list:
    """vLLM's prompt_logprobs of `prompt` as the engine scores it (through the ZeroMQ client)."""
    res = ln.client.generate(np.asarray(prompt, np.int64), 1, sampling=Sampling(prompt_logprobs=K))
    tok, out = ByteTokenizer(), [None]
    for i, (lp, rank) in enumerate(zip(res.prompt_logprobs, res.prompt_ranks)):
        entry = {int(prompt[i + 1]): (lp, rank)}
        for r, (a, alp) in enumerate(zip(*res.prompt_top[i])):
            entry.setdefault(int(a), (alp, r + 1))
        out.append({str(a): {"logprob": v, "rank": int(r), "decoded_token": tok.decode([a])}
                    for a, (v, r) in entry.items()})
    return out


def test_answers_past_the_limit_are_refused_and_large_ones_come_as_they_are_made(node, tmp_path):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "1024", "--http-port", str(http)) as ln:
        _wait_healthy(http)
        base = f"http://127.0.0.1:{http}"
        with httpx2.Client(timeout=120) as c:
            huge = c.post(base + "/v1/completions", json={
                "model": MODEL, "prompt": [[(7 * i + j) % 256 for j in range(4000)] for i in range(4)], "n": 16,
                "prompt_logprobs": 20, "max_tokens": 1})
            assert huge.status_code == 400, huge.text[:300]
            err = huge.json()["error"]
            assert err["code"] == "answer_too_large" and str(MAX_ENTRIES) in err["message"], err
            assert ln.engine_stats()["seqs_running"] == 0

            prompt = [(3 * j + 1) % 256 for j in range(2000)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": K}
            r = c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200, r.text[:300]
            assert "content-length" not in r.headers and r.headers.get("transfer-encoding") == "chunked"
            want = _scores(ln, prompt)
            assert r.json()["choices"][0]["prompt_logprobs"] == want

            with routing([base], "round-robin") as router:
                via = c.post(router + "/v1/completions", json=body)
                assert via.status_code == 200, via.text[:300]
                assert "content-length" not in via.headers, "the router held the answer whole"
                assert via.json()["choices"][0]["prompt_logprobs"] == want
        assert ln.proc.poll() is None
