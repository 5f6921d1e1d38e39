"""Each architecture of tests/hfkit.py's ARCH_CASES (Mistral, Llama with dynamic RoPE, Qwen2
and Qwen3 with sliding windows, Gemma 2 and 3, Qwen3-MoE, Qwen2-MoE, Phi-3 with longrope)
served by a real node (`kvrt launch --model DIR`, config.json written by transformers' own
config classes) answers the independent float64 reference's greedy tokens: F32 files at --tp 1
with a device pool so small that cached blocks are evicted, BF16 files
at --tp 2 with swaps to the host tier; shared prefixes hit the prefix cache (windows of 12
tokens over blocks of 8: a hit's boundary falls inside the window), concurrently and one by
one, with every order checked against the blocks' owners (KVRT_CHECK_OWNERSHIP=1). A checkpoint
whose sliding and full layers differ (Gemma 2 and 3, Qwen2 and Qwen3 with use_sliding_window)
is served with layer groups (a page per group, each node given the same memory in pages), in
float32 and FP8 pages; and a P->D pair hands Gemma 3's groups over, sending only the sliding
layer's last window, and answers the same tokens."""
from __future__ import annotations

import pytest

from kvrt.ipc.layout import LayerGroups
from kvrt.workers.model.checkpoint import inspect
from tests.hfkit import ARCH_CASES, VOCAB, case_config, greedy, make_checkpoint
from tests.launched import launched, shared_prefix_prompts
from tests.runtime.engine.test_oracle import NEW, run_all, tokens
from tests.runtime.pd.test_pd import pd_node, pd_pair  # noqa: F401 (pd_node is a fixture)

pytestmark = pytest.mark.e2e

OPTS = ("--block-size", "8", "--max-num-batched-tokens", "64")
SETUPS = {  # (file dtype, tp, device blocks, host blocks)
    "tp1-evict": ("F32", 1, 40, 0),
    "tp2-swap": ("BF16", 2, 48, 64),
}


def pages_per_block(path: str) -> int:
    """How many pool blocks (pages) hold one block of tokens of every layer: a checkpoint whose
    sliding and full layers form layer groups has a page per group (ipc/layout.py LayerGroups)."""
    c = inspect(path).config
    return c.num_layers // LayerGroups.of(c.layer_windows(c.max_position_embeddings) or [0] * c.num_layers).page_layers


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=11, vocab=VOCAB)


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_architecture_served_exactly(node, tmp_path, prompts, case, setup):
    served_exactly(node, tmp_path, prompts, case, setup)


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_gemma_layer_groups_with_fp8_blocks(node, tmp_path, prompts, case, setup):
    """Gemma's sliding and full layers in layer groups of FP8 pages, evicted and swapped: the
    reference rounds K and V to e4m3 as the pool stores them (tests/hfkit.py `kv_rounding`)."""
    served_exactly(node, tmp_path, prompts, case, setup, "fp8")


def served_exactly(node, tmp_path, prompts, case: str, setup: str, kv: str = "float32") -> None:
    dtype, tp, device_blocks, host_blocks = SETUPS[setup]
    arch, cfg = case_config(case, tied=dtype == "BF16")
    ck = make_checkpoint(tmp_path / "ck", arch, dtype=dtype, config=cfg, seed=7)
    want = [greedy(ck, p, NEW, kv) for p in prompts]
    pages = pages_per_block(ck.path)  # the same memory in pages of a layer group
    opts = (*OPTS, "--model", ck.path, "--tp", str(tp), "--num-gpu-blocks", str(device_blocks * pages),
            "--num-cpu-blocks", str(host_blocks * pages), *(("--kv-cache-dtype", kv) if kv == "fp8" else ()))
    with launched(node, tmp_path / "logs", *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        assert tokens(run_all(ln.client, prompts)) == want, ln.logs()
        again = run_all(ln.client, prompts, concurrent=False)
        assert tokens(again) == want, ln.logs()
        assert sum(r.cached_tokens for r in again) > 0, "shared prefixes must hit the prefix cache"
        stats = ln.idle_stats()
        assert stats["device_used"] == 0 and stats["host_used"] == 0
        assert stats["evictions"] > 0, f"{device_blocks} blocks for 12 requests must evict cached blocks"
        if host_blocks:
            assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0


@pytest.mark.parametrize("kv", ["float32", "fp8"])
def test_prefill_decode_pair_serves_gemma3(pd_node, tmp_path, prompts, kv):
    """Gemma 3's layer groups across a P->D pair, in float32 and FP8 pages: P sends every
    block's full-attention page but the sliding layer's pages of the prompt's last window only."""
    arch, cfg = case_config("gemma3", tied=True)
    ck = make_checkpoint(tmp_path / "ck", arch, dtype="BF16", config=cfg, seed=2)
    want = [greedy(ck, p, NEW, kv) for p in prompts[:6]]
    flags = ("--kv-cache-dtype", kv) if kv == "fp8" else ()
    with pd_pair(pd_node, tmp_path, "--model", ck.path, *flags, env={"KVRT_CHECK_OWNERSHIP": "1"}) as (p, d):
        first = prompts[0]
        assert tokens(run_all(p.client, [first])) == want[:1], p.logs() + d.logs()
        page = 2 * 8 * 2 * 16 * (1 if kv == "fp8" else 4)  # one layer's K and V: 8 tokens, 2 heads of 16
        blocks = -(-len(first) // 8)
        window = blocks - (len(first) - 12 + 1) // 8  # the sliding layer's pages from the first token on
        assert p.idle_stats()["pd_sent_bytes"] == (blocks + window) * page
        assert tokens(run_all(p.client, prompts[:6])) == want, p.logs() + d.logs()
