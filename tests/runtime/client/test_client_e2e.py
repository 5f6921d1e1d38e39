"""The client side against real nodes (`kvrt launch --port`): streaming, EOS, the generate and
replay commands, the demo workload, and `kvrt bench replay`, which launches its own node.

The exactness of the answers (cache on/off, concurrency, swaps against the dense model) is
tests/runtime/engine/test_oracle.py's job; here the point is that what the client, the commands and the
workload drivers report matches what the node did.
"""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

import numpy as np
import pytest

from kvrt.runtime.client.api import TokenEvent
from kvrt.runtime.client.client import Client, RequestError, Result
from kvrt.runtime.client.demo import render, run_demo
from kvrt.runtime.client.replay import replay, trace_prompts
from kvrt.runtime.client.trace import TraceRequest, ideal_hit_tokens
from tests.conftest import REPO, leftovers
from tests.launched import SMALL, launched, oracle
from tests.runtime.client.test_demo_workload import small_trace, write_trace

pytestmark = pytest.mark.e2e


def kvrt(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    """One node for the module: the SMALL model (block size 8), room for every prompt below."""
    name = "e" + uuid.uuid4().hex[:10]
    with launched(name, tmp_path_factory.mktemp("logs"), *SMALL, "--num-gpu-blocks", "1024") as node:
        yield node
    assert not leftovers(name)


def test_info_and_streaming_match_the_answer(ln):
    info = ln.client.info()
    assert (info.node, info.block_size, info.vocab_size) == (ln.node, 8, 512)
    prompt = np.arange(3, 40, dtype=np.int32)
    want = oracle().generate_dense(prompt, 12)
    with Client(ln.port, timeout=30) as c:
        gen = c.stream(prompt, 12)
        streamed = list(gen)
        r = gen.result
        assert streamed == r.output_token_ids.tolist() == want
        assert r.finish_reason == "length" and r.prompt_tokens == len(prompt)
        assert 0 < r.ttft_ms <= r.e2e_ms and r.engine_ttft_ms <= r.ttft_ms
        # the same prompt again: every full block but the last token's is served by the device tier
        again = c.generate(prompt, 12)
        assert again.cached_device == (len(prompt) - 1) // 8 * 8
        assert again.computed_prompt_tokens == len(prompt) - again.cached_device
        assert again.output_token_ids.tolist() == want


def test_eos_stops_early(ln):
    prompt = [7, 8, 9, 10]
    want = oracle().generate_dense(np.array(prompt), 10)
    eos = want[3]
    r = ln.client.generate(prompt, 10, eos_token_id=eos)
    assert r.finish_reason == "eos" and r.output_token_ids.tolist() == want[:want.index(eos) + 1]


def test_many_in_flight_on_one_client(ln):
    model = oracle()
    prompts = [np.arange(i, i + 20 + i, dtype=np.int32) % 512 for i in range(10)]
    with Client(ln.port, timeout=30) as c:
        ids = {c.submit(p, 5): i for i, p in enumerate(prompts)}
        seen: dict[str, list[int]] = {rid: [] for rid in ids}
        done: dict[str, Result] = {}
        while len(done) < len(ids):
            evs = c.poll(30)
            assert evs, "no event from the node within 30 s"
            for ev in evs:
                if isinstance(ev, TokenEvent):
                    seen[ev.request_id] += list(ev.token_ids)
                else:
                    assert isinstance(ev, Result), ev
                    done[ev.request_id] = ev
    for rid, i in ids.items():
        assert seen[rid] == done[rid].output_token_ids.tolist() == model.generate_dense(prompts[i], 5)


def test_engine_errors_raise_request_error(ln):
    with pytest.raises(RequestError) as e:
        ln.client.generate([1, 2, 10_000], 2)
    assert e.value.code == "bad_request"
    with pytest.raises(RequestError):
        ln.client.generate([], 2)
    assert ln.client.generate([1, 2], 1).num_output_tokens == 1


def test_a_prompt_too_long_for_the_nodes_socket_is_refused_by_the_client_naming_the_limit(ln):
    """The node's socket drops a message over its size limit unread: the client says why
    before sending, instead of a request that never answers."""
    model_len = ln.client.info().max_model_len
    with pytest.raises(ValueError, match=f"max_model_len \\({model_len}\\)"):
        ln.client.generate(np.ones(model_len + 20_000, np.int32), 1)
    assert ln.client.in_flight == 0
    assert ln.client.generate([1, 2], 1).num_output_tokens == 1


def test_generate_cli(ln):
    prompt = [5, 6, 7, 8]
    want = oracle().generate_dense(np.array(prompt), 6)
    r = kvrt("generate", "--port", str(ln.port), "--prompt-ids", ",".join(map(str, prompt)),
             "--max-new-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["output_token_ids"] == want and out["finish_reason"] == "length" and out["prompt_tokens"] == 4
    assert set(out["cached_tokens"]) == {"device", "host", "storage"} and out["ttft_ms"] > 0
    r = kvrt("generate", "--port", str(ln.port), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "6")
    assert r.returncode == 0 and r.stdout.split() == [str(t) for t in want]
    r = kvrt("generate", "--port", str(ln.port), "--text", "héllo", "--max-new-tokens", "4", "--no-cache")
    assert r.returncode == 0 and "[length] 4 tokens" in r.stderr
    r = kvrt("generate", "--port", str(ln.port), "--prompt-ids", "1,512", "--max-new-tokens", "2")
    assert r.returncode == 2 and "vocabulary 0..511" in r.stderr
    r = kvrt("generate", "--port", str(ln.port), "--prompt-ids", "1,2", "--max-new-tokens", "100000")
    assert r.returncode == 1 and "bad_request" in r.stderr


def test_replay_hits_the_ideal_at_concurrency_1(ln, tmp_path):
    """One request at a time with room for every block: the node's hit rate is the trace's ideal."""
    reqs = small_trace() + [TraceRequest(9000, 1500, 5, (1, 9, 70))]
    trace = tmp_path / "t.jsonl"
    write_trace(trace, reqs)
    info = ln.client.info()
    specs = trace_prompts(reqs, 32, vocab_size=info.vocab_size, max_new_tokens_cap=3)
    ideal = ideal_hit_tokens([s.trace for s in specs], info.block_size, 32)
    with Client(ln.port, timeout=30) as c:
        res = replay(c, specs, concurrency=1)
    assert res.completed == len(reqs) and not res.errors
    assert res.cached["device"] == ideal > 0 and res.computed_prompt_tokens == res.prompt_tokens - ideal
    # the same through the command, with other ids (so nothing is cached from the above)
    write_trace(trace, [TraceRequest(r.timestamp_ms, r.input_length, r.output_length,
                                     tuple(h + 100_000 for h in r.hash_ids)) for r in reqs])
    r = kvrt("replay", "--port", str(ln.port), "--trace", str(trace), "--tokens-per-id", "24", "--speed", "0",
             "--concurrency", "1", "--max-new-tokens-cap", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["completed"] == len(reqs) and out["errors"] == 0 and out["output_tokens"] == 2 * len(reqs)
    assert out["hit_rate"]["device"] == pytest.approx(out["ideal_hit_rate"]) and out["ideal_hit_rate"] > 0


def test_demo_workload_runs(ln):
    lines = []
    res = run_demo(ln.port, lines.append, seed=5, conversations=6, turns=(2, 3), new_tokens=(4, 8))
    s = res.summary
    assert s["completed"] == res.workload.total_requests and s["errors"] == 0
    assert s["hit_rate"]["device"] > 0.3 and s["computed_prompt_tokens"] < s["prompt_tokens"]
    assert "hit rate" in render(res) and lines


def test_bench_replay_on_vs_off(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, small_trace())
    r = kvrt("bench", "replay", "--trace", str(trace), "--tokens-per-id", "32", "--concurrency", "1",
             "--max-new-tokens-cap", "2", "--launch-args", " ".join(SMALL[:-2]), "--json", timeout=240)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    on, off = out["on"], out["off"]
    assert on["completed"] == off["completed"] == 7 and on["errors"] == off["errors"] == 0
    assert on["hit_rate"]["total"] == pytest.approx(out["ideal_hit_rate"]) and out["ideal_hit_rate"] > 0
    assert off["hit_rate"]["total"] == 0 and off["computed_prompt_tokens"] == off["prompt_tokens"]
    assert out["ratio_off_on"]["computed_prompt_tokens"] > 1


def test_launch_demo():
    r = kvrt("launch", "--demo", "--num-layers", "2", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    for word in ("kvrt demo on node", "TTFT mean / p50 / p99", "hit rate", "prompt tokens computed", "tokens/s"):
        assert word in r.stdout
