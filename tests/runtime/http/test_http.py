"""The OpenAI-compatible HTTP API (`kvrt launch --http-port H`), driven by the real `openai`
client against real launched nodes: its greedy tokens are the ZeroMQ client's, its usage counts
are exact, its errors have the OpenAI shape and status, and a client that goes away mid-stream
frees its blocks. The 503 paths (node not ready, engine stopping) are unit tests over a fake
bridge, since a real node's shutdown cannot be caught at a chosen moment."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from kvrt.runtime.client.api import ErrorEvent
from kvrt.runtime.client.chat_template import ChatTemplate, Message
from kvrt.runtime.client.tokenizer import ByteTokenizer, HFTokenizer
from kvrt.runtime.http.app import Server, create_app
from kvrt.runtime.http.openai_schema import CompletionRequest
from tests.conftest import REPO
from tests.hfkit import greedy, make_checkpoint
from kvrt.ipc.ports import free_port
from tests.launched import SMALL, launched
from tests.runtime.http.fake_bridge import FakeBridge
from tests.tokenizer_kit import make_tokenizer_dir

MODEL = "kvrt-reference"


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)


def _wait_healthy(port: int, timeout: float = 30.0) -> None:
    """Wait until the HTTP server has the node's info (it asks once the engine answers)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"the HTTP server on port {port} was not healthy within {timeout:g} s") from None
        time.sleep(0.05)  # a test waiting for another process


@pytest.fixture
def ref_node(node, tmp_path):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "96", "--http-port", str(http), "--metrics-port",
                  str(free_port())) as ln:
        _wait_healthy(http)
        yield ln, _client(http), http


@pytest.mark.e2e
def test_completions_give_the_zeromq_greedy_tokens_and_exact_usage(ref_node):
    ln, oa, http = ref_node
    rng = np.random.default_rng(3)
    a, b = (rng.integers(0, 512, n).tolist() for n in (37, 21))
    want_a = ln.client.generate(a, 6, use_cache=False).output_token_ids.tolist()
    want_b = ln.client.generate(b, 6, use_cache=False).output_token_ids.tolist()

    r = oa.completions.create(model=MODEL, prompt=a, max_tokens=6, temperature=0)
    assert r.choices[0].token_ids == want_a
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (37, 6, 43)
    # the same prompt again: its full blocks come from the prefix cache
    again = oa.completions.create(model=MODEL, prompt=a, max_tokens=6, temperature=0)
    assert again.choices[0].token_ids == want_a
    assert again.usage.prompt_tokens_details.cached_tokens == 32

    stream = oa.completions.create(model=MODEL, prompt=a, max_tokens=6, temperature=0, stream=True,
                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert [t for c in chunks for ch in c.choices for t in ch.token_ids] == want_a
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["length"]

    batch = oa.completions.create(model=MODEL, prompt=[a, b], max_tokens=6, temperature=0)
    assert [c.token_ids for c in sorted(batch.choices, key=lambda c: c.index)] == [want_a, want_b]
    assert batch.usage.prompt_tokens == 58 and batch.usage.completion_tokens == 12

    text = oa.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
    assert text.choices[0].token_ids == ln.client.generate(list(b"hello"), 4).output_token_ids.tolist()
    assert text.usage.prompt_tokens == 5 and text.usage.completion_tokens == 4
    assert oa.completions.create(model=MODEL, prompt="hello", max_tokens=None).usage.completion_tokens == 16

    lp = oa.completions.create(model=MODEL, prompt=a, max_tokens=6, temperature=0, logprobs=0)
    assert lp.choices[0].token_ids == want_a
    assert len(lp.choices[0].logprobs.token_logprobs) == 6
    assert all(x <= 0 for x in lp.choices[0].logprobs.token_logprobs)

    full = ByteTokenizer().decode(ln.client.generate(a, 40).output_token_ids.tolist())
    k = next(i for i in range(1, len(full)) if full[i].isascii() and full[i].isprintable() and full.find(full[i]) == i)
    cut = oa.completions.create(model=MODEL, prompt=a, max_tokens=40, temperature=0, stop=[full[k], "\x00zz"])
    assert cut.choices[0].text == full[:k] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.prompt_tokens_details.cached_tokens == 32, "a request cut at a stop string reports its usage"

    models = oa.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=30) as r:
        assert "kvrt_requests" in r.read().decode()


@pytest.mark.e2e
def test_each_bad_input_is_a_400_in_the_openai_shape(ref_node):
    ln, oa, http = ref_node
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model="nope", prompt=[1, 2])
    assert e.value.body["code"] == "model_not_found"
    bad = [dict(model=MODEL, prompt=[1, 99999]),
           dict(model=MODEL, prompt=[1, 2], max_tokens=5000),
           dict(model=MODEL, prompt=[1, 2], max_tokens=0),
           dict(model=MODEL, prompt=[1, 2], temperature=-1),
           dict(model=MODEL, prompt=[1, 2], extra_body={"min_p": 1.5}),
           dict(model=MODEL, prompt=[1, 2], extra_body={"max_tokens": "many"}),
           dict(model=MODEL, prompt=[1, 2], extra_body={"stop": [""]})]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(**kwargs)
        err = e.value.body
        assert set(err) >= {"message", "type", "param", "code"}, err
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", data=b"{not json",
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "error" in json.loads(e.value.read())
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model=MODEL, prompt=[1, 2], seed=1 << 70)
    with socket.create_connection(("127.0.0.1", http), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n{" % (1 << 40))
        assert s.recv(4096).startswith(b"HTTP/1.1 413 "), "a body too large is refused before it is read"
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=30) as r:
        assert r.status == 200
    assert ln.client.generate([1, 2, 3], 2).finish_reason == "length", "the node still serves"


@pytest.mark.e2e
def test_an_http_port_in_use_fails_the_launch(node, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "launch", "--node", node, "--port", str(free_port()),
                            "--http-port", str(port), *SMALL], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr


@pytest.mark.e2e
def test_a_client_that_leaves_mid_stream_cancels_its_request(ref_node):
    ln, oa, _ = ref_node
    stream = oa.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=700, temperature=0, stream=True)
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].token_ids)
        if got >= 3:
            break
    stream.close()
    e = ln.idle_stats(timeout=20)
    assert not e["device_used"] and not e["seqs_running"], "the cancelled request's blocks were freed"
    assert e["generated_tokens"] < 700, "the request was cancelled, not run to its end"


def leave_before_a_whole_answer(ln, port: int) -> None:
    """Ask for a 700-token answer without a stream on `port` (the node's or a router's), hang up
    once the node is generating it, and check that the node cancelled it (its blocks are free)."""
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 700, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 20
        while not ln.engine_stats()["generated_tokens"]:  # leave once the answer is under way
            assert time.monotonic() < deadline, "the request did not start within 20 s"
            time.sleep(0.01)  # a test waiting for another process
    e = ln.idle_stats(timeout=20)
    assert not e["device_used"] and not e["seqs_running"], "the cancelled request's blocks were freed"
    assert e["generated_tokens"] < 700, "the request was cancelled, not run to its end"


@pytest.mark.e2e
def test_a_client_that_leaves_before_a_whole_answer_cancels_its_request(ref_node):
    ln, _, http = ref_node
    leave_before_a_whole_answer(ln, http)


@pytest.mark.e2e
def test_many_concurrent_streams(ref_node):
    ln, _, http = ref_node

    async def one(oa: openai.AsyncOpenAI, i: int) -> list[int]:
        s = await oa.completions.create(model=MODEL, prompt=[i % 500, 1, 2], max_tokens=3, temperature=0,
                                        stream=True)
        return [t async for c in s for ch in c.choices for t in ch.token_ids]

    async def all_of() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", timeout=120,
                                      max_retries=0) as oa:
            return await asyncio.gather(*(one(oa, i) for i in range(200)))

    outs = asyncio.run(all_of())
    assert all(len(o) == 3 for o in outs)
    assert outs[7] == ln.client.generate([7, 1, 2], 3).output_token_ids.tolist()


@pytest.mark.e2e
def test_chat_against_a_checkpoint_gives_the_reference_answer(node, tmp_path):
    directory = tmp_path / "qwen2"
    ck = make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320)
    make_tokenizer_dir(directory)
    tok = HFTokenizer.from_dir(str(directory))
    question = "What is a KV cache?"
    prompt = tok.encode(ChatTemplate(tok.chat_template, tok.special_tokens).render([Message("user", question)]),
                        add_special_tokens=False)
    want = greedy(ck, prompt, 8)
    for i, t in enumerate(want):
        if t in tok.eos_token_ids:
            want = want[:i + 1]
            break
    http = free_port()
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "128",
                  "--http-port", str(http)) as ln:
        _wait_healthy(http)
        oa = _client(http)
        model = str(directory)  # the --model argument as given, as vLLM names it
        assert [m.id for m in oa.models.list().data] == [model]
        msgs = [{"role": "user", "content": question}]
        r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].model_extra["token_ids"] == want
        shown = [t for t in want if t not in tok.eos_token_ids]
        assert r.choices[0].message.content == tok.decode(shown)
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want)
        parts = [{"role": "user", "content": [{"type": "text", "text": question[:5]},
                                              {"type": "text", "text": question[5:]}]}]
        lp = oa.chat.completions.create(model=model, messages=parts, max_tokens=8, temperature=0, logprobs=True)
        assert lp.choices[0].model_extra["token_ids"] == want, "text parts are the same message"
        assert len(lp.choices[0].logprobs.content) == len(want)
        s = oa.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
        chunks = list(s)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(shown)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, "the second ask hits the prefix cache"
        assert ln.client.generate(prompt, 1).output_token_ids.tolist() == want[:1]


# ---- 503: unit tests over a fake bridge ------------------------------------------------------------

class _FakeBridge(FakeBridge):
    """A bridge whose engine answers every request with one ErrorEvent."""

    def __init__(self, ready: bool, code: str = "stopping") -> None:
        super().__init__(ready)
        self.code = code

    def submit(self, sub) -> None:
        self.put(sub, ErrorEvent(sub.request_id, self.code, "the node is stopping"))


@pytest.mark.parametrize("ready,code,status", [(False, "stopping", 503), (True, "stopping", 503),
                                              (True, "too_many_requests", 429)])
def test_a_node_that_cannot_serve_now_answers_503_and_an_http_clients_quota_429(ready, code, status):
    with TestClient(create_app(Server(_FakeBridge(ready, code), MODEL)), raise_server_exceptions=False) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "stream": stream})
            assert r.status_code == (503 if not ready else status), r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert ("over capacity" in r.json()["error"]["message"]) == (ready and status == 429)
        assert c.get("/health").status_code == (200 if ready else 503)


class _EosTokenizer:
    eos_token_ids = (5, 6)


@pytest.mark.parametrize("ignore", [False, True])
def test_ignore_eos_drops_every_eos_id(ignore):
    """vLLM's `ignore_eos`, which serving benchmarks send, turns off the model's EOS ids."""
    server = Server(_FakeBridge(True), MODEL)
    server._tokenizer = _EosTokenizer()
    body = CompletionRequest(model=MODEL, prompt=[1], ignore_eos=ignore)
    eos, sampling = server.sampling(body)
    assert (eos, list(sampling.stop_token_ids)) == ((-1, []) if ignore else (5, [6]))
