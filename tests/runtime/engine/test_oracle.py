"""Exact-output oracle: real nodes (engine, worker, cache-transfer processes) must give the
same greedy tokens as the dense reference forward, whatever the prefix cache, the pool size,
swaps, evictions, preemptions or concurrency do. Any wrong block table, block reused before
its KV was written, or swap racing the forward pass shows up as a wrong token.

Each case also runs with KVRT_CHECK_OWNERSHIP=1, where every order is checked against the
owner of every block it touches.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.runtime.client.client import Client, RequestError
from tests.launched import SMALL, crowding_prompts, launched, oracle, shared_prefix_prompts

pytestmark = pytest.mark.e2e

NEW = 6
OWNERSHIP = [pytest.param({}, id="plain"), pytest.param({"KVRT_CHECK_OWNERSHIP": "1"}, id="ownership")]


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=7)


@pytest.fixture(scope="module")
def expected(prompts):
    model = oracle()
    return [model.generate_dense(p, NEW) for p in prompts]


def run_all(client, prompts, use_cache=True, concurrent=True, new=NEW):
    """Outputs in prompt order; all submitted at once, or one after another."""
    if not concurrent:
        return [client.generate(p, new, use_cache=use_cache) for p in prompts]
    ids = [client.submit(p, new, use_cache=use_cache) for p in prompts]
    results = {}
    while len(results) < len(ids):
        events = client.poll(timeout=60)
        assert events, "no event from the node within 60 s"
        for ev in events:
            if hasattr(ev, "code"):
                raise AssertionError(f"request failed: {ev}")
            if hasattr(ev, "output_token_ids"):
                results[ev.request_id] = ev
    return [results[i] for i in ids]


def tokens(results):
    return [r.output_token_ids.tolist() for r in results]


@pytest.mark.parametrize("env", OWNERSHIP)
def test_cache_on_off_and_dense_agree(node, tmp_path, prompts, expected, env):
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "256", env=env) as ln:
        seq = run_all(ln.client, prompts, concurrent=False)
        assert tokens(seq) == expected
        assert sum(r.cached_device for r in seq) > 0, "shared prefixes must hit the device tier"
        off = run_all(ln.client, prompts, use_cache=False)
        assert tokens(off) == expected
        assert all(r.cached_tokens == 0 for r in off)
        assert all(r.computed_prompt_tokens == r.prompt_tokens for r in off)
        on = run_all(ln.client, prompts)
        assert tokens(on) == expected
        stats = ln.idle_stats()
        assert stats["device_used"] == 0, "finished requests must hold no blocks"


@pytest.mark.parametrize("env", OWNERSHIP)
@pytest.mark.parametrize("host_blocks", [0, 64], ids=["evict", "swap"])
def test_tiny_pool_swaps_evicts_preempts(node, tmp_path, prompts, expected, env, host_blocks):
    opts = (*SMALL, "--num-gpu-blocks", "40", "--num-cpu-blocks", str(host_blocks),
            "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env=env) as ln:
        first = run_all(ln.client, prompts)
        assert tokens(first) == expected, ln.logs()
        second = run_all(ln.client, prompts, concurrent=False)
        assert tokens(second) == expected, ln.logs()
        stats = ln.idle_stats()
        assert stats["device_used"] == 0 and stats["host_used"] == 0
        assert stats["evictions"] > 0, "40 blocks for 12 requests must evict cached blocks"
        if host_blocks:
            assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0
            assert sum(r.cached_host for r in first + second) > 0, "some prefix must come back from the host"


@pytest.mark.parametrize("env", OWNERSHIP)
def test_shared_prefix_arriving_during_prefill(node, tmp_path, env):
    """Requests sharing a long prefix arrive while the first is still prefilling in chunks;
    each gets what it gets alone (no block is read before its KV is written)."""
    rng = np.random.default_rng(3)
    head = rng.integers(0, 512, 300)
    prompts = [np.concatenate([head, rng.integers(0, 512, n)]).astype(np.int32) for n in (1, 9, 17, 30)]
    model = oracle()
    want = [model.generate_dense(p, NEW) for p in prompts]
    with launched(node, tmp_path, *SMALL, "--max-num-batched-tokens", "32", env=env) as ln:
        got = run_all(ln.client, prompts)
        assert tokens(got) == want
        alone = run_all(ln.client, prompts[:1], use_cache=False)
        assert tokens(alone) == want[:1]


def test_bad_requests_get_clear_errors_and_change_nothing(node, tmp_path):
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64", "--max-model-len", "400") as ln:
        c = ln.client
        cases = [
            (dict(prompt=[1] * 390, max_new_tokens=20), "max_model_len"),
            (dict(prompt=[1, 2, 600], max_new_tokens=2), "out of range"),
            (dict(prompt=[1, -1], max_new_tokens=2), "out of range"),
            (dict(prompt=[1, 2], max_new_tokens=0), "max_new_tokens"),
        ]
        for kw, words in cases:
            with pytest.raises(RequestError) as e:
                c.generate(kw["prompt"], kw["max_new_tokens"])
            assert e.value.code == "bad_request" and words in str(e.value), str(e.value)
        long_id = c.submit(list(range(100)), 200)
        with Client(ln.port, timeout=30) as other:
            with pytest.raises(RequestError) as e:
                other.generate([5, 6, 7], 2, request_id=long_id)
        assert e.value.code == "duplicate"
        c.cancel(long_id)
        ok = c.generate([5, 6, 7], 3)
        assert ok.output_token_ids.tolist() == oracle().generate_dense(np.array([5, 6, 7]), 3)
        cancelled = [ev for ev in c.poll(timeout=10) if getattr(ev, "request_id", "") == long_id]
        assert cancelled and cancelled[-1].finish_reason == "cancelled"
        stats = ln.idle_stats()
        assert stats["device_used"] == 0 and stats["failed_requests"] == 0


@pytest.mark.parametrize("env", OWNERSHIP)
def test_storage_tier_survives_a_restart(node, tmp_path, prompts, expected, env):
    """Blocks are written through to file storage on release; a new node on the same directory
    lists them at start and serves prefixes from storage, with the same answers."""
    opts = (*SMALL, "--num-gpu-blocks", "256", "--storage", f"file:{tmp_path / 'store'}")
    with launched(node, tmp_path / "a", *opts, env=env) as ln:
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == expected
        assert ln.idle_stats()["tasks_done"] > 0, "released requests write their blocks through"
    with launched(node, tmp_path / "b", *opts, env=env) as ln:
        again = run_all(ln.client, prompts, concurrent=False)
        assert tokens(again) == expected, ln.logs()
        assert again[0].cached_storage > 0, "the first request after a restart reads its prefix from storage"
        stats = ln.idle_stats()
        assert stats["hit_tokens_storage"] > 0 and stats["tasks_failed"] == 0


def test_two_ranks_with_swaps(node, tmp_path, prompts):
    """--tp 2: both workers compute, both cache-transfer ranks swap; rank 0's tokens are the
    answer of the model over one rank's share of the KV heads."""
    model = oracle(tp=2)
    want = [model.generate_dense(p, NEW) for p in prompts]
    opts = (*SMALL, "--tp", "2", "--num-gpu-blocks", "48", "--num-cpu-blocks", "64", "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        assert tokens(run_all(ln.client, prompts)) == want, ln.logs()
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == want
        stats = ln.idle_stats()
        assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0 and stats["device_used"] == 0


def test_a_tiny_device_with_a_host_tier_serves_two_rounds_sent_together(node, tmp_path):
    """24 device and 48 host blocks of 16 tokens; 14 prompts of 1-300 tokens, half of the longer
    ones behind one 96-token prefix, all sent at once, twice. The second round's swap-ins wait
    together for more device blocks than the pool has (each fits alone): requests used to wait
    for ever while the engine evicted and swapped in a loop."""
    prompts = crowding_prompts()
    model = oracle()
    want = [model.generate_dense(p, 16) for p in prompts]
    opts = (*SMALL, "--block-size", "16", "--num-gpu-blocks", "24", "--num-cpu-blocks", "48")
    with launched(node, tmp_path, *opts) as ln:
        for _ in range(2):
            got = run_all(ln.client, prompts, new=16)
            assert tokens(got) == want, ln.logs()
        stats = ln.idle_stats()
        assert stats["device_used"] == 0 and stats["host_used"] == 0
        assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0
