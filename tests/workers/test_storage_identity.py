"""The storage tier never serves another model's KV: nodes started one after the other on one
storage directory, with models whose blocks have the same byte size but other contents, share
no block, and each answers as its own dense reference."""
from __future__ import annotations

import pytest

from kvrt.ipc.config import NodeConfig
from tests.launched import SMALL, launched, oracle, shared_prefix_prompts
from kvrt.workers.model.transformer import Model, ModelShape

pytestmark = pytest.mark.e2e

NEW = 4
# SMALL's blocks: 2 layers x K/V x 8 tokens x 2 heads x 16 dims x 4 bytes = 4096 bytes
OTHERS = [
    pytest.param(("--num-layers", "1", "--num-kv-heads", "2", "--head-dim", "32", "--block-size", "8"),
                 {"num_layers": 1, "num_kv_heads": 2, "head_dim": 32}, id="layers-x-head-dim"),
    pytest.param((*SMALL, "--vocab-size", "256"),
                 {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 256}, id="vocabulary"),
]


@pytest.mark.parametrize("other_opts, other_shape", OTHERS)
def test_a_node_with_another_model_reads_no_foreign_block(node, tmp_path, other_opts, other_shape):
    prompts = shared_prefix_prompts(seed=11, systems=2, users=2, vocab=256)
    store = ("--num-gpu-blocks", "128", "--storage", f"file:{tmp_path / 'store'}")
    with launched(node, tmp_path / "a", *SMALL, *store) as ln:
        first = [ln.client.generate(p, NEW) for p in prompts]
        assert [r.output_token_ids.tolist() for r in first] == [oracle().generate_dense(p, NEW) for p in prompts]
        assert ln.idle_stats()["tasks_done"] > 0, "finished requests write their blocks through to storage"
    other = Model(ModelShape.from_config(NodeConfig(node="", **other_shape)))
    with launched(node, tmp_path / "b", *other_opts, *store) as ln:
        again = [ln.client.generate(p, NEW) for p in prompts]
        assert [r.output_token_ids.tolist() for r in again] == [other.generate_dense(p, NEW) for p in prompts], \
            ln.logs()
        assert all(r.cached_storage == 0 for r in again), "the other model's blocks must not match"
        assert ln.idle_stats()["hit_tokens_storage"] == 0


def test_fp8_and_float_nodes_share_no_block_and_fp8_nodes_share_theirs(node, tmp_path):
    """--kv-cache-dtype fp8 blocks have the same shape as another node's and half the bytes:
    their keys are rooted in the KV dtype, so a float32 node after an FP8 one on the same store
    reads none of its blocks, and a second FP8 node reads them all and answers as the dense
    reference over e4m3-rounded K and V."""
    from kvrt.ipc.layout import FP8_E4M3

    prompts = shared_prefix_prompts(seed=12, systems=2, users=2)
    store = ("--num-gpu-blocks", "128", "--storage", f"file:{tmp_path / 'store'}")
    fp8 = Model(oracle().shape, kv_dtype=FP8_E4M3)
    want = [fp8.generate_dense(p, NEW) for p in prompts]
    with launched(node, tmp_path / "a", *SMALL, *store, "--kv-cache-dtype", "fp8") as ln:
        assert [ln.client.generate(p, NEW).output_token_ids.tolist() for p in prompts] == want
        assert ln.idle_stats()["tasks_done"] > 0, "finished requests write their blocks through to storage"
    with launched(node, tmp_path / "b", *SMALL, *store) as ln:
        again = [ln.client.generate(p, NEW) for p in prompts]
        assert [r.output_token_ids.tolist() for r in again] == [oracle().generate_dense(p, NEW) for p in prompts]
        assert ln.idle_stats()["hit_tokens_storage"] == 0, "a float32 node read FP8 blocks"
    with launched(node, tmp_path / "c", *SMALL, *store, "--kv-cache-dtype", "fp8_e4m3") as ln:
        third = [ln.client.generate(p, NEW) for p in prompts]
        assert [r.output_token_ids.tolist() for r in third] == want
        assert third[0].cached_storage > 0, "an FP8 node finds the blocks another FP8 node stored"
