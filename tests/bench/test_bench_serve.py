"""`kvrt bench serve`: run as a real subprocess against a real node's HTTP port (and its ZeroMQ
port for the native comparison), and checked through its --json output: counts, ordered
percentiles, exact token totals, a prefix-cache hit rate for prompts that share prefixes, a
too-long prompt skipped (not sent, not failed) with its reason, failures counted with a non-zero
exit, and an unreachable or silent URL refused within seconds without a traceback. How a server
that does not publish max_model_len is learnt from its 400 answer is a unit test over a fake
transport (no real server words its errors that way)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid

import httpx2
import pytest

from kvrt.bench.serve import Arrival, Request, ServerError, Slo, run_http, summarize, synthetic_requests
from kvrt.bench.serve import main as serve_main
from tests.conftest import REPO, leftovers
from kvrt.ipc.ports import free_port
from tests.launched import SMALL, launched
from tests.runtime.http.test_http import _wait_healthy

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One node for the module (a launch costs more than the runs): (HTTP port, ZeroMQ port)."""
    name = "t" + uuid.uuid4().hex[:10]
    http = free_port()
    with launched(name, tmp_path_factory.mktemp("logs"), *SMALL, "--num-gpu-blocks", "96", "--max-model-len",
                  str(MAX_MODEL_LEN), "--http-port", str(http)) as ln:
        _wait_healthy(http)
        yield http, ln.port
    assert not leftovers(name), f"shared-memory objects leaked: {leftovers(name)}"


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "serve", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _ordered(stats: dict) -> bool:
    return stats["p50"] <= stats["p90"] <= stats["p99"]


@pytest.mark.e2e
def test_synthetic_run_reports_the_standard_figures_next_to_native(served):
    http, zmq_port = served
    opts = dict(n=12, num_prefixes=2, prefix_len=64, suffix_len=16, max_tokens=4, vocab_size=512, seed=5)
    r = bench("--url", f"http://127.0.0.1:{http}/v1", "--limit", "12", "--num-prefixes", "2", "--prefix-len", "64",
              "--suffix-len", "16", "--max-tokens", "4", "--seed", "5", "--concurrency", "3",
              "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--compare-zmq", str(zmq_port), "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("kvrt bench serve: 12 synthetic requests (2 shared prefixes of 64 tokens")
    out = json.loads(r.stdout)
    assert out["config"]["model"] == "kvrt-reference" and out["config"]["max_model_len"] == MAX_MODEL_LEN
    prompt_tokens = sum(len(q.prompt) for q in synthetic_requests(**opts))
    for side in ("http", "native"):
        s = out[side]
        assert (s["completed"], s["failed"], s["skipped"]) == (12, 0, 0), s
        assert s["input_tokens"] == prompt_tokens and s["output_tokens"] == 12 * 4
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert _ordered(s[key]), (side, key, s[key])
        assert s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
        assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])
        assert s["output_token_throughput"] == pytest.approx(48 / s["duration_s"])
        assert s["good_requests"] == 12 and s["goodput"] == pytest.approx(s["request_throughput"])
        # ten of the twelve prompts start with a prefix seen before, one of them maybe sent beside the
        # first with that prefix (3 in flight): at least nine hit 56 or more of its 64 tokens
        assert s["cached_tokens"] >= 9 * 56
        assert 0 < s["prefix_cache_hit_rate"] == pytest.approx(s["cached_tokens"] / prompt_tokens)
    ratio = out["ratio_http_native"]
    assert ratio["ttft_ms"]["p50"] == pytest.approx(out["http"]["ttft_ms"]["p50"] / out["native"]["ttft_ms"]["p50"])


@pytest.mark.e2e
def test_table_output_says_what_it_ran_first(served):
    http, _ = served
    r = bench("--url", f"http://127.0.0.1:{http}/v1", "--limit", "4", "--prefix-len", "16", "--suffix-len", "8",
              "--max-tokens", "2", "--request-rate", "50", "--slo-ttft-ms", "60000")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("kvrt bench serve: 4 synthetic requests") and "request rate 50/s (Poisson)" in lines[0]
    assert any(line.startswith("completed requests") and line.split()[-1] == "4" for line in lines)
    assert any(line.startswith("TTFT p99 (ms)") for line in lines)
    assert any(line.startswith("requests meeting the SLO") and line.split()[-1] == "4" for line in lines)
    assert "SLO: TTFT <= 60000 ms" in lines


@pytest.mark.e2e
def test_a_prompt_longer_than_max_model_len_is_skipped_and_reported(served, tmp_path):
    http, _ = served
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 5, "input_length": 1024 * 10, "output_length": 3, "hash_ids": list(range(1, 21))},
            {"timestamp": 9, "input_length": 1500, "output_length": 3, "hash_ids": [1, 2, 3]}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in rows))
    # 16 tokens per id: 32, 320 (over 256) and 47 tokens
    r = bench("--url", f"http://127.0.0.1:{http}/v1", "--trace", str(trace), "--tokens-per-id", "16",
              "--concurrency", "1", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["http"]
    assert (s["completed"], s["failed"], s["skipped"]) == (2, 0, 1)
    # the limit came from /v1/models: skipped before sending (a sent one would carry the server's reason)
    assert s["skipped_reasons"] == {f"prompt + max_tokens > max_model_len {MAX_MODEL_LEN}": 1}
    assert s["input_tokens"] == 32 + 47 and s["output_tokens"] == 6
    assert s["cached_tokens"] >= 24  # one at a time: the third prompt starts with the first one's 32 tokens


@pytest.mark.e2e
def test_failed_requests_are_counted_and_exit_non_zero(served):
    http, _ = served
    # ids up to 999 against a 512-token vocabulary: the server refuses them (400, not a length problem)
    r = bench("--url", f"http://127.0.0.1:{http}/v1", "--limit", "3", "--prefix-len", "8", "--suffix-len", "40",
              "--vocab-size", "1000", "--max-tokens", "2", "--json")
    assert r.returncode == 1
    s = json.loads(r.stdout)["http"]
    assert s["failed"] == 3 and s["completed"] == 0 and s["skipped"] == 0
    assert all(why.startswith("HTTP 400:") and "outside the vocabulary" in why for why in s["errors"])
    assert "3 requests failed" in r.stderr


@pytest.mark.e2e
def test_nothing_listening_fails_fast_with_a_message():
    port = free_port()
    r = bench("--url", f"http://127.0.0.1:{port}/v1", timeout=30)  # a hang is a TimeoutExpired here
    assert r.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port}/v1/models" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.e2e
def test_a_server_that_never_answers_is_given_up_on(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as srv:  # accepts connections (backlog), never answers
        port = srv.getsockname()[1]
        r = bench("--url", f"http://127.0.0.1:{port}/v1", "--json", timeout=30)
    assert r.returncode == 1
    assert "no answer from" in r.stderr and "within 5 s" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.e2e
def test_bad_url_is_a_usage_error():
    r = bench("--url", "127.0.0.1:8000/v1", timeout=30)
    assert r.returncode == 2 and "--url must be http://HOST:PORT/v1" in r.stderr


# ---- a server that publishes no max_model_len (unit test over a fake transport) --------------

class _VllmLike:
    """Answers like vLLM: /v1/models without max_model_len, a 400 naming the limit for a prompt
    that is too long, a 503 for prompts starting with 7, otherwise a stream of one token per event."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sent: list[int] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        body = json.loads(request.content)
        self.sent.append(len(body["prompt"]))
        n = len(body["prompt"]) + body["max_tokens"]
        if n > self.limit:
            message = f"This model's maximum context length is {self.limit} tokens. However, you requested {n} tokens."
            return httpx2.Response(400, json={"object": "error", "message": message, "code": 400})
        if body["prompt"][0] == 7:
            return httpx2.Response(503, json={"error": {"message": "overloaded", "code": "busy"}})
        events = [{"choices": [{"index": 0, "text": "x"}]} for _ in range(body["max_tokens"])]
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                "completion_tokens": body["max_tokens"]}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx2.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def test_the_limit_is_learnt_from_the_first_too_long_answer():
    server = _VllmLike(limit=50)
    reqs = [Request(0, [1] * 10, 4), Request(1, [1] * 60, 4), Request(2, [1] * 70, 4), Request(3, [7] * 5, 4),
            Request(4, [1] * 20, 4)]
    target, outcomes, duration = run_http("http://fake/v1", None, reqs, Arrival(1, None), 10.0,
                                          transport=httpx2.MockTransport(server))
    assert target.model == "m" and target.max_model_len is None
    status = [o.status for o in sorted(outcomes, key=lambda o: o.index)]
    assert status == ["completed", "skipped", "skipped", "failed", "completed"]
    assert "maximum context length is 50" in outcomes[1].reason
    assert outcomes[2].reason == "prompt + max_tokens > max_model_len 50"
    assert 70 not in server.sent  # learnt from the 60-token answer: never sent
    s = summarize(outcomes, duration, Slo())
    assert (s["completed"], s["failed"], s["skipped"]) == (2, 1, 2)
    assert s["errors"] == {"HTTP 503: overloaded": 1}
    assert s["cached_tokens"] is None and s["prefix_cache_hit_rate"] is None  # reported as n/a
    assert s["output_tokens"] == 8 and s["goodput"] is None


def test_a_stream_cut_before_done_is_a_failure():
    def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"data": [{"id": "m", "max_model_len": 100}]})
        whole = json.loads(request.content)["prompt"] == [0, 1, 2, 3]  # the warm-up request
        return httpx2.Response(200, content=b'data: {"choices": [{"text": "a"}]}\n\n' + b"data: [DONE]\n\n" * whole)

    target, outcomes, _ = run_http("http://fake/v1", None, [Request(0, [1, 2], 2)], Arrival(1, None), 10.0,
                                   transport=httpx2.MockTransport(handler))
    assert target.max_model_len == 100
    assert [(o.status, o.reason) for o in outcomes] == [("failed", "the stream ended without [DONE]")]


def test_usage_of_the_wrong_types_is_not_trusted():
    def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"data": [{"id": "m", "max_model_len": "big"}]})
        usage = {"prompt_tokens": "x", "completion_tokens": True, "prompt_tokens_details": {"cached_tokens": -3}}
        events = [{"choices": [{"text": "a", "token_ids": [5, 6]}]}, {"choices": [], "usage": usage}]
        return httpx2.Response(200, content=("".join(f"data: {json.dumps(e)}\n\n" for e in events)
                                             + "data: [DONE]\n\n").encode())

    target, outcomes, duration = run_http("http://fake/v1", None, [Request(0, [1, 2, 3], 2)], Arrival(1, None), 10.0,
                                          transport=httpx2.MockTransport(handler))
    assert target.max_model_len is None
    (o,) = outcomes
    assert (o.status, o.prompt_tokens, o.output_tokens, o.cached_tokens) == ("completed", 3, 2, None)


def test_whole_answers_are_timed_end_to_end_and_checked():
    """--no-stream asks for whole answers: E2E and the usage counts, no TTFT (the client sees every
    token at the end); an answer without output is a failure."""
    asked = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"data": [{"id": "m", "max_model_len": 100}]})
        body = json.loads(request.content)
        asked.append((body["stream"], "stream_options" in body))
        text = "" if body["prompt"][0] == 9 else "ab"
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": 1}}
        return httpx2.Response(200, json={"choices": [{"index": 0, "text": text}], "usage": usage})

    _, outcomes, duration = run_http("http://fake/v1", None, [Request(0, [1, 2, 3], 2), Request(1, [9, 2], 2)],
                                     Arrival(1, None), 10.0, transport=httpx2.MockTransport(handler), stream=False)
    assert set(asked) == {(False, False)}
    done, empty = sorted(outcomes, key=lambda o: o.index)
    assert (done.status, done.prompt_tokens, done.output_tokens, done.cached_tokens) == ("completed", 3, 2, 1)
    assert done.e2e_s is not None and done.ttft_s is None and not done.itl_s
    assert empty.status == "failed" and empty.reason.startswith("an answer without output")
    s = summarize(outcomes, duration, Slo())
    assert s["ttft_ms"]["p50"] is None and s["e2e_ms"]["p50"] is not None


def test_no_stream_refuses_the_streamed_figures_options(capsys):
    with pytest.raises(SystemExit) as e:
        serve_main(["--url", "http://127.0.0.1:9/v1", "--no-stream", "--slo-ttft-ms", "100"])
    assert e.value.code == 2 and "--no-stream measures E2E only" in capsys.readouterr().err


def _card_server(card: dict, tokens: list | None = None):
    def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"data": [{"id": "m", **card}]})
        if request.url.path == "/tokenize" and tokens is not None:
            return httpx2.Response(200, json={"tokens": tokens, "count": len(tokens)})
        return httpx2.Response(404, json={"error": {"message": "no such route"}})

    return httpx2.MockTransport(handler)


def test_the_vocabulary_is_the_servers_from_its_card_or_its_tokenize():
    from kvrt.bench.serve import server_vocab

    assert server_vocab("http://fake/v1", None, _card_server({"vocab_size": 384}))[0] == 384
    v, source = server_vocab("http://fake/v1", None, _card_server({}, tokens=[5, 300, 17]))
    assert v == 301 and "tokenize" in source
    assert server_vocab("http://fake/v1", None, _card_server({}))[0] is None


@pytest.mark.e2e
def test_token_ids_stay_inside_a_small_models_vocabulary(node, tmp_path):
    """A 384-token model: ids drawn up to 511 failed every request before the vocabulary was read
    from the server; now every request completes with only the URL given."""
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--vocab-size", "384", "--num-gpu-blocks", "96", "--max-model-len",
                  str(MAX_MODEL_LEN), "--http-port", str(http)):
        _wait_healthy(http)
        r = bench("--url", f"http://127.0.0.1:{http}/v1", "--limit", "8", "--prefix-len", "32", "--suffix-len", "8",
                  "--max-tokens", "2", "--concurrency", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["config"]["vocab_size"] == 384 and out["http"]["completed"] == 8, out["http"]


def test_a_failed_warm_up_stops_the_run():
    sent = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"data": [{"id": "m"}]})
        sent.append(json.loads(request.content)["prompt"])
        return httpx2.Response(400, json={"error": {"message": "bad token id", "code": "invalid_token_id"}})

    with pytest.raises(ServerError, match="warm-up request .* failed"):
        run_http("http://fake/v1", None, [Request(i, [1, 2], 2) for i in range(5)], Arrival(1, None), 10.0,
                 transport=httpx2.MockTransport(handler))
    assert sent == [[0, 1, 2, 3]]  # the warm-up alone
