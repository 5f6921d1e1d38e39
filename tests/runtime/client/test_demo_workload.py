"""Workloads on the client side: the demo's conversations, trace scaling (--tokens-per-id) and its
ideal hit rate, and the replay driver and `kvrt replay` against the fake node of test_client."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.runtime.client.api import GenerateRequest
from kvrt.runtime.client.client import Client
from kvrt.runtime.client.demo import ConversationSource, Workload, build_workload, render, run_demo
from kvrt.runtime.client.replay import (PromptSpec, ReplayResult, TraceSource, replay,
                            scaled_length, scaled_tokens, trace_prompts)
from kvrt.runtime.client.trace import TRACE_BLOCK, TraceRequest, default_trace_path, expand_tokens, ideal_hit_tokens, load_trace
from tests.runtime.client.test_client import BLOCK, FAIL_TOKEN, FakeNode, kvrt


def scale_request(req: TraceRequest, tokens_per_id: int) -> TraceRequest:
    """The request with T tokens per id (hash ids and times kept, input_length scaled)."""
    return dataclasses.replace(req, input_length=scaled_length(req.input_length, tokens_per_id))


# ---- the demo workload -----------------------------------------------------------------------


def test_demo_workload_is_deterministic():
    a, b = build_workload(7, 512), build_workload(7, 512)
    assert all(np.array_equal(x, y) for x, y in zip(a.system_prompts, b.system_prompts))
    for ca, cb in zip(a.conversations, b.conversations):
        assert ca.system == cb.system and ca.max_new_tokens == cb.max_new_tokens
        assert all(np.array_equal(x, y) for x, y in zip(ca.user, cb.user))
    c = build_workload(8, 512)
    assert not all(np.array_equal(x, y) for x, y in zip(a.system_prompts, c.system_prompts))


def test_demo_workload_structure():
    w = build_workload(0, 300)
    assert len(w.conversations) == 24 and len(w.system_prompts) == 3
    assert all(3 <= c.turns <= 4 for c in w.conversations)
    assert w.total_requests == sum(c.turns for c in w.conversations)
    # several conversations start with each shared system prompt
    firsts = [w.first_prompt(c) for c in w.conversations]
    for s, sp in enumerate(w.system_prompts):
        users = [f for f, c in zip(firsts, w.conversations) if c.system == s]
        assert len(users) >= 2 and all(np.array_equal(f[:len(sp)], sp) for f in users)
    for c in w.conversations:
        assert all(16 <= n <= 32 for n in c.max_new_tokens)
        assert all(0 <= t.min() and t.max() < 300 for t in c.user)
    # each turn's prompt extends the previous one by the answer and the new message
    c = w.conversations[0]
    prompt = w.first_prompt(c)
    assert 100 <= len(prompt) <= 600
    for k in range(1, c.turns):
        answer = np.arange(c.max_new_tokens[k - 1], dtype=np.int32)
        nxt = Workload.next_prompt(prompt, answer, c.user[k])
        assert len(nxt) == len(prompt) + len(answer) + len(c.user[k]) and np.array_equal(nxt[:len(prompt)], prompt)
        prompt = nxt
    assert len(prompt) <= 600


def test_demo_workload_sizes_are_parameters():
    w = build_workload(1, 50, conversations=5, turns=(2, 2), system_prompts=1, system_tokens=(10, 10),
                       user_tokens=(3, 3), new_tokens=(1, 1))
    assert w.total_requests == 10 and all(len(w.first_prompt(c)) == 13 for c in w.conversations)
    with pytest.raises(ValueError):
        build_workload(0, 50, turns=(3, 2))


def test_conversation_source_orders_turns_and_skips_after_a_failure():
    w = build_workload(0, 50, conversations=2, turns=(3, 3))
    src = ConversationSource(w)
    a, b = src.next_ready(0), src.next_ready(0)
    assert (a.tag, b.tag) == ((0, 0), (1, 0)) and src.next_ready(0) is None and not src.exhausted()
    src.completed(b, None)  # conversation 1 fails: its other turns are dropped
    assert src.total == 4 and src.abandoned == 2
    from kvrt.runtime.client.client import Result

    src.completed(a, Result("x", np.array([9, 9], dtype=np.int32), "length", len(a.prompt)))
    nxt = src.next_ready(0)
    assert nxt.tag == (0, 1) and np.array_equal(nxt.prompt[:len(a.prompt) + 2], np.r_[a.prompt, 9, 9])
    assert not src.exhausted()


def test_demo_runs_against_a_node_and_uses_the_actual_answers():
    sizes = dict(conversations=6, turns=(2, 3), system_prompts=2, system_tokens=(40, 60), user_tokens=(8, 20),
                 new_tokens=(3, 6))
    lines = []
    with FakeNode() as f:
        res = run_demo(f.port, lines.append, seed=3, concurrency=4, **sizes)
        sent = [m for m in f.received if isinstance(m, GenerateRequest)]
    w = res.workload
    assert res.summary["completed"] == w.total_requests == len(sent) and res.summary["errors"] == 0
    assert lines and "demo:" in lines[-1]
    # every later turn = the previous turn's prompt + the fake's answer to it + the next message
    by_prompt = {np.asarray(m.prompt).tobytes(): m for m in sent}
    for c in w.conversations:
        prompt = w.first_prompt(c)
        for k in range(c.turns):
            m = by_prompt[prompt.tobytes()]
            assert m.max_new_tokens == c.max_new_tokens[k]
            answer = [(int(prompt[-1]) + i + 1) % 1000 for i in range(m.max_new_tokens)]
            if k + 1 < c.turns:
                prompt = Workload.next_prompt(prompt, np.array(answer, dtype=np.int32), c.user[k + 1])
    assert res.summary["hit_rate"]["device"] > 0.3  # system prompts and histories are reused
    text = render(res)
    for word in ("TTFT mean / p50 / p99", "hit rate", "prompt tokens computed", "tokens/s", "device"):
        assert word in text


# ---- trace scaling ---------------------------------------------------------------------------

ids_st = st.lists(st.integers(0, 5), min_size=1, max_size=6)


def naive_ideal(prompts: list[np.ndarray], block: int) -> int:
    """Leading full blocks whose whole token prefix was seen before (the last block given back
    when everything matched), requests one after another."""
    seen: set = set()
    hits = 0
    for p in prompts:
        keys, key = [], None
        for k in range(len(p) // block):
            key = (key, p[k * block:(k + 1) * block].tobytes())  # the whole prefix, exactly
            keys.append(key)
        m = 0
        while m < len(keys) and keys[m] in seen:
            m += 1
        if m * block == len(p):
            m -= 1
        hits += m * block
        seen.update(keys)
    return hits


def trace_from(ids_lists, tails) -> list[TraceRequest]:
    """Requests with prefix-consistent ids: a request's ids are a path in a small tree."""
    out = []
    for i, (ids, tail) in enumerate(zip(ids_lists, tails)):
        path, node = [], 0
        for h in ids:
            node = node * 7 + h + 1  # id of the path so far: equal ids <=> equal prefixes
            path.append(node)
        out.append(TraceRequest(i * 1000, (len(path) - 1) * TRACE_BLOCK + tail, 10, tuple(path)))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(ids_st, min_size=1, max_size=8), st.data(), st.sampled_from([1, 3, 8, 16, 64]),
       st.sampled_from([1, 4, 16, 32]))
def test_scaling_keeps_sharing_and_the_ideal_matches_a_naive_count(ids_lists, data, tpi, block):
    tails = [data.draw(st.integers(1, TRACE_BLOCK)) for _ in ids_lists]
    reqs = trace_from(ids_lists, tails)
    prompts = [scaled_tokens(r, tpi) for r in reqs]
    for r, p in zip(reqs, prompts):
        assert len(p) == scaled_length(r.input_length, tpi)
        assert (len(r.hash_ids) - 1) * tpi < len(p) <= len(r.hash_ids) * tpi
    # equal id prefixes <=> equal token prefixes
    for a, pa in zip(reqs, prompts):
        for b, pb in zip(reqs, prompts):
            k = 0
            while k < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[k] == b.hash_ids[k]:
                k += 1
            n = min(len(pa), len(pb), k * tpi)
            assert np.array_equal(pa[:n], pb[:n])
            if n < min(len(pa), len(pb)):
                assert pa[n] != pb[n]
    scaled = [scale_request(r, tpi) for r in reqs]
    assert ideal_hit_tokens(scaled, block, tpi) == naive_ideal(prompts, block)


def test_full_scale_is_the_trace_formula_and_ideal():
    reqs = load_trace(default_trace_path(), 300)
    for r in reqs[:20]:
        assert np.array_equal(scaled_tokens(r, TRACE_BLOCK), expand_tokens(r))
    prompts = [expand_tokens(r) for r in reqs[:100]]
    for block in (16, 64, 512):
        assert ideal_hit_tokens(reqs[:100], block) == naive_ideal(prompts, block)
    # in a small vocabulary, token prefixes are shared exactly where id prefixes are
    for tpi, vocab in ((16, 512), (8, 256), (4, 1000)):
        specs = trace_prompts(reqs[:200], tpi, vocab_size=vocab)
        assert naive_ideal([s.prompt for s in specs], 16) == ideal_hit_tokens([s.trace for s in specs], 16, tpi)
    # scaled by 1/32: the same fraction of reusable tokens, up to the partial last blocks
    t16 = [scale_request(r, 16) for r in reqs]
    rate16 = ideal_hit_tokens(t16, 16, 16) / sum(r.input_length for r in t16)
    rate512 = ideal_hit_tokens(reqs, 512) / sum(r.input_length for r in reqs)
    assert abs(rate16 - rate512) < 0.02


@pytest.mark.parametrize("vocab", [256, 512, 1000, 32000])
def test_vocab_reduction_keeps_ids_apart(vocab):
    """`% vocab` of the trace's token words depends on the position alone for power-of-two
    vocabularies up to 512: every id would expand to the same tokens. High bits do not."""
    a, b = TraceRequest(0, 512, 1, (1,)), TraceRequest(0, 512, 1, (2,))
    ta, tb = scaled_tokens(a, 64, vocab), scaled_tokens(b, 64, vocab)
    assert ta.min() >= 0 and max(ta.max(), tb.max()) < vocab
    assert (ta != tb).mean() > 0.9
    assert len(set(ta.tolist())) > min(vocab, 64) // 2


def test_trace_prompts_caps_and_fits():
    reqs = [TraceRequest(5000, 1000, 300, (1, 2)), TraceRequest(7000, 600, 0, (1, 3))]
    specs = trace_prompts(reqs, 64, vocab_size=100, max_new_tokens_cap=8, max_model_len=100)
    assert [s.max_new_tokens for s in specs] == [8, 1]
    assert [s.arrival_s for s in specs] == [0.0, 2.0]
    assert [len(s.prompt) for s in specs] == [92, 75] == [s.trace.input_length for s in specs]
    assert all(s.prompt.max() < 100 for s in specs)
    assert np.array_equal(specs[0].prompt[:64], specs[1].prompt[:64])


# ---- the replay driver -----------------------------------------------------------------------


def test_trace_source_clock():
    specs = [PromptSpec(np.array([1]), 1, t) for t in (0.0, 2.0, 1.0)]
    src = TraceSource(specs, speed=2.0)
    assert src.next_ready(0).arrival_s == 0.0 and src.next_ready(0.4) is None and src.next_due() == 0.5
    assert src.next_ready(0.5).arrival_s == 1.0 and src.next_ready(1.0).arrival_s == 2.0 and src.exhausted()
    fast = TraceSource(specs, speed=math.inf)
    assert [fast.next_ready(0) is not None for _ in range(3)] == [True] * 3
    with pytest.raises(ValueError):
        TraceSource(specs, speed=-1)


def small_trace() -> list[TraceRequest]:
    ids = [[0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2, 5], [6], [0, 1, 3, 7], [0, 4, 8]]
    return trace_from([[h % 5 for h in x] for x in ids], [200, 512, 37, 300, 512, 1, 400])


def test_replay_at_concurrency_1_reaches_the_ideal_hit_rate():
    reqs = small_trace()
    specs = trace_prompts(reqs, 32, vocab_size=1000, max_new_tokens_cap=4)
    with FakeNode() as f, Client(f.port, timeout=5) as c:
        res = replay(c, specs, speed=0, concurrency=1)
    s = res.summary()
    assert s["completed"] == s["requests"] == len(reqs) and s["errors"] == 0
    ideal = ideal_hit_tokens([sp.trace for sp in specs], BLOCK, 32)
    assert s["cached_tokens"]["device"] == ideal > 0
    assert s["prompt_tokens"] == sum(len(sp.prompt) for sp in specs)
    assert s["computed_prompt_tokens"] == s["prompt_tokens"] - ideal
    assert s["output_tokens"] == sum(sp.max_new_tokens for sp in specs)
    assert s["ttft_ms"]["p50"] > 0 and s["throughput"]["req_per_s"] > 0


def test_replay_counts_errors_and_goes_on():
    specs = [PromptSpec(np.array([FAIL_TOKEN if i % 3 == 0 else 1, i], dtype=np.int32), 3) for i in range(9)]
    progress = []
    with FakeNode() as f, Client(f.port, timeout=5) as c:
        res = replay(c, specs, concurrency=4, use_cache=False, progress=progress.append)
    assert (res.completed, res.errors) == (6, {"bad_request": 3})
    assert progress[-1].done == 9 and progress[-1].in_flight == 0
    assert res.summary()["hit_rate"]["total"] == 0


def test_replay_silent_node_raises_and_names_the_wait():
    from kvrt.runtime.client.client import ClientError

    specs = [PromptSpec(np.array([1, 2], dtype=np.int32), 3) for _ in range(3)]
    with FakeNode(silent=True) as f, Client(f.port, timeout=5) as c:
        with pytest.raises(ClientError, match=r"no answer from .* for 0.3 s with 2 requests in flight"):
            replay(c, specs, concurrency=2, timeout=0.3)


def test_empty_result_summary_has_no_numbers():
    s = ReplayResult().summary()
    assert s["ttft_ms"]["p50"] is None and s["hit_rate"]["total"] is None


# ---- kvrt replay -----------------------------------------------------------------------------


def write_trace(path, reqs: list[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


@pytest.mark.e2e
def test_replay_cli_json_and_table(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, small_trace())
    with FakeNode() as f:
        r = kvrt("replay", "--port", str(f.port), "--trace", str(trace), "--tokens-per-id", "32", "--speed", "0",
                 "--concurrency", "1", "--max-new-tokens-cap", "3", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["completed"] == 7 and out["errors"] == 0 and out["output_tokens"] == 21
        assert out["hit_rate"]["device"] == pytest.approx(out["ideal_hit_rate"]) and out["ideal_hit_rate"] > 0
        assert "7/7 done" in r.stderr
        r = kvrt("replay", "--port", str(f.port), "--trace", str(trace), "--tokens-per-id", "8", "--speed", "100",
                 "--limit", "4", "--no-cache")
        assert r.returncode == 0, r.stderr
        for word in ("TTFT p50 / p90 / p99", "TPOT p50 / p99", "throughput", "prompt tokens computed",
                     "hit rate", "ideal hit rate", "4 done of 4"):
            assert word in r.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("args, msg", [
    (["--trace", "/nonexistent/trace.jsonl"], "no such file"),
    (["--tokens-per-id", "0"], "--tokens-per-id"),
    (["--tokens-per-id", "513"], "--tokens-per-id"),
    (["--concurrency", "0"], "--concurrency"),
    (["--speed", "-1"], "--speed"),
    (["--limit", "0"], "--limit"),
])
def test_replay_cli_bad_args_exit_2(args, msg):
    r = kvrt("replay", "--port", "5", *args)
    assert r.returncode == 2 and msg in r.stderr


def test_replay_cli_missing_default_trace_says_pass_trace(tmp_path, monkeypatch, capsys):
    import kvrt.runtime.client.replay as rp

    monkeypatch.setattr(rp, "default_trace_path", lambda: tmp_path / "missing.jsonl")
    with pytest.raises(SystemExit) as ei:
        rp.main(["--port", "5"])
    assert ei.value.code == 2 and "pass --trace" in capsys.readouterr().err


@pytest.mark.e2e
def test_replay_cli_no_node_exits_1(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, small_trace()[:1])
    r = kvrt("replay", "--port", "1", "--trace", str(trace), "--timeout", "0.5")
    assert r.returncode == 1 and "tcp://127.0.0.1:1" in r.stderr


def test_progress_bar_on_a_terminal_and_in_a_log():
    import io

    from kvrt.runtime.client.replay import Progress, ProgressBar

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        bar = ProgressBar("x", stream, every_s=0)
        bar(Progress(0, 4, 0, 2, 0.0))
        bar(Progress(4, 4, 1, 0, 2.0))
    assert re.search(r"x: 100%.*4/4 \[\d\d:\d\d<.*errors=1", tty.getvalue()) and tty.getvalue().endswith("\n")
    assert log.getvalue().splitlines()[-1] == "x: 4/4 done, 0 in flight, 2.0 req/s, ETA 0 s, 1 errors"
