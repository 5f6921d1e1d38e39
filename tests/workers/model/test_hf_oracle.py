"""Exact greedy outputs of a real node serving a checkpoint (`kvrt launch --model DIR`): the
same tokens as the independent dense float64 reference of tests/hfkit.py, with the prefix cache
on and off, and with pools so small that blocks are evicted, swapped to the host tier and
requests preempted."""
from __future__ import annotations

import pytest

from tests.hfkit import VOCAB, greedy, make_checkpoint, transformers_config
from tests.launched import launched, shared_prefix_prompts
from tests.runtime.engine.test_oracle import NEW, run_all, tokens
from tests.runtime.pd.test_pd import pd_node, pd_pair  # noqa: F401 (pd_node is a fixture)

pytestmark = pytest.mark.e2e

OPTS = ("--block-size", "8")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=3)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=11, vocab=VOCAB)


@pytest.fixture(scope="module")
def expected(checkpoint, prompts):
    return [greedy(checkpoint, p, NEW) for p in prompts]


def test_cache_on_off_and_dense_agree(node, tmp_path, checkpoint, prompts, expected):
    with launched(node, tmp_path, *OPTS, "--model", checkpoint.path, "--num-gpu-blocks", "256") as ln:
        info = ln.client.info()
        assert info.vocab_size == VOCAB and info.max_model_len == 512
        seq = run_all(ln.client, prompts, concurrent=False)
        assert tokens(seq) == expected, ln.logs()
        assert sum(r.cached_device for r in seq) > 0, "shared prefixes must hit the device tier"
        off = run_all(ln.client, prompts, use_cache=False)
        assert tokens(off) == expected
        assert all(r.cached_tokens == 0 for r in off)
        assert tokens(run_all(ln.client, prompts)) == expected


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["evict", "swap"])
def test_tiny_pool_swaps_evicts_preempts(node, tmp_path, checkpoint, prompts, expected, host_blocks):
    opts = (*OPTS, "--model", checkpoint.path, "--num-gpu-blocks", "40", "--num-cpu-blocks", str(host_blocks),
            "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        assert tokens(run_all(ln.client, prompts)) == expected, ln.logs()
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == expected, ln.logs()
        stats = ln.idle_stats()
        assert stats["device_used"] == 0 and stats["host_used"] == 0
        assert stats["evictions"] > 0, "40 blocks for 12 requests must evict cached blocks"
        if host_blocks:
            assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_other_architectures_served_exactly(node, tmp_path, arch, prompts):
    ck = make_checkpoint(tmp_path / "ck", arch, dtype="F32", seed=5, shards=2 if arch == "Qwen3ForCausalLM" else 1)
    want = [greedy(ck, p, NEW) for p in prompts[:4]]
    with launched(node, tmp_path / "logs", *OPTS, "--model", ck.path) as ln:
        assert tokens(run_all(ln.client, prompts[:4])) == want, ln.logs()


@pytest.mark.parametrize("arch,rope", [
    ("Qwen3ForCausalLM", {"rope_type": "default", "rope_theta": 1e6}),
    ("LlamaForCausalLM", {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0,
                          "original_max_position_embeddings": 64}),
], ids=["qwen3-theta", "llama-yarn"])
def test_transformers5_config_served_exactly(node, tmp_path, arch, rope, prompts):
    """config.json written by transformers 5's own config class (RoPE only inside
    rope_parameters): the reference's tokens, which read it through that class."""
    cfg = transformers_config(arch, rope, tied=True)
    ck = make_checkpoint(tmp_path / "ck", arch, dtype="BF16", seed=6, config=cfg)
    want = [greedy(ck, p, NEW) for p in prompts[:4]]
    with launched(node, tmp_path / "logs", *OPTS, "--model", ck.path) as ln:
        assert tokens(run_all(ln.client, prompts[:4])) == want, ln.logs()


def test_two_ranks_equal_one(node, tmp_path, checkpoint, prompts, expected):
    """--tp 2: each worker holds half the heads and MLP, the all-reduce sums their outputs;
    the greedy tokens are the unsplit reference's, with swaps on both ranks."""
    opts = (*OPTS, "--model", checkpoint.path, "--tp", "2", "--num-gpu-blocks", "48", "--num-cpu-blocks", "64",
            "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        assert tokens(run_all(ln.client, prompts)) == expected, ln.logs()
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == expected, ln.logs()
        stats = ln.idle_stats()
        assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0 and stats["device_used"] == 0


def test_float16_compute_serves_the_reference(node, tmp_path, checkpoint, prompts, expected):
    """--compute-dtype float16 on a CPU node (what a GPU picks for this BF16 checkpoint): the
    KV pools follow the compute dtype, and the greedy tokens are still the float64 reference's,
    through the prefix cache, evictions and swaps, over two ranks."""
    import numpy as np

    from kvrt.runtime.node.status import snapshot

    opts = (*OPTS, "--model", checkpoint.path, "--compute-dtype", "float16", "--tp", "2", "--num-gpu-blocks", "48",
            "--num-cpu-blocks", "64", "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        assert {np.dtype(p["dtype"]) for p in snapshot(ln.node)["pools"]} == {np.dtype(np.float16)}
        assert tokens(run_all(ln.client, prompts)) == expected, ln.logs()
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == expected, ln.logs()
        stats = ln.idle_stats()
        assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0 and stats["device_used"] == 0


def test_prefill_decode_pair_serves_the_checkpoint(pd_node, tmp_path, prompts):
    """P prefills, D decodes from the KV P handed over: the reference's tokens. (The pair's
    shape flags agree with this checkpoint's config.json, so they are accepted.)"""
    ck = make_checkpoint(tmp_path / "ck", "Qwen3ForCausalLM", dtype="BF16", tied=True, seed=2)
    want = [greedy(ck, p, NEW) for p in prompts[:6]]
    with pd_pair(pd_node, tmp_path, "--model", ck.path, env={"KVRT_CHECK_OWNERSHIP": "1"}) as (p, d):
        assert tokens(run_all(p.client, prompts[:6])) == want, p.logs() + d.logs()
        assert p.idle_stats()["pd_sent_bytes"] > 0


def test_growing_requests_preempted_and_recomputed(node, tmp_path, checkpoint):
    """Requests admitted together outgrow a tiny pool while decoding: the most recently admitted
    are preempted and later recomputed, and every answer is still the reference's."""
    import numpy as np

    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, int(n)).astype(np.int32) for n in rng.integers(17, 24, 8)]
    new = 40
    want = [greedy(checkpoint, p, new) for p in prompts]
    opts = (*OPTS, "--model", checkpoint.path, "--num-gpu-blocks", "24", "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        ids = [ln.client.submit(p, new) for p in prompts]
        done = {}
        while len(done) < len(ids):
            events = ln.client.poll(timeout=60)
            assert events, "no event from the node within 60 s"
            for ev in events:
                assert not hasattr(ev, "code"), f"request failed: {ev}"
                if hasattr(ev, "output_token_ids"):
                    done[ev.request_id] = ev.output_token_ids.tolist()
        assert [done[i] for i in ids] == want, ln.logs()
        stats = ln.idle_stats()
        assert stats["preemptions"] > 0 and stats["device_used"] == 0
