"""The node config's model backend: bfloat16 compute only where the torch backend computes it,
the torch backend only for a checkpoint, and its own block keys (its kernels round in another
order than the array path's: other KV bytes, never shared through a storage tier)."""
from __future__ import annotations

import pytest

from kvrt.runtime.node.config import ConfigError, NodeConfig

BASE = dict(node="n", model_dir="/m", model_arch="Qwen2ForCausalLM", model_fingerprint="f", hidden_size=32)


def test_bfloat16_is_the_torch_backends():
    NodeConfig(**BASE, compute_dtype="bfloat16", model_backend="torch").validate()
    with pytest.raises(ConfigError, match="compute-dtype"):
        NodeConfig(**BASE, compute_dtype="bfloat16").validate()
    with pytest.raises(ConfigError, match="model-backend"):
        NodeConfig(node="n", model_backend="torch").validate()
    with pytest.raises(ConfigError, match="model-backend"):
        NodeConfig(**BASE, model_backend="jax").validate()


def test_the_torch_backend_roots_its_own_block_keys():
    array = NodeConfig(**BASE, compute_dtype="float16").key_root
    torch = NodeConfig(**BASE, compute_dtype="float16", model_backend="torch").key_root
    bf16 = NodeConfig(**BASE, compute_dtype="bfloat16", model_backend="torch").key_root
    assert len({array, torch, bf16}) == 3
    assert NodeConfig(**BASE).key_root == NodeConfig(**BASE, model_backend="array").key_root  # as before


def test_the_torch_backend_serves_neither_fp8_blocks_nor_layer_groups():
    """What the torch layer does not implement is a config error, whoever wrote the config (the
    launcher refuses it sooner, naming the checkpoint's switch: workers/model/backends.py)."""
    NodeConfig(**BASE, kv_cache_dtype="fp8").validate()
    NodeConfig(**BASE, num_layers=2, layer_windows=[0, 8]).validate()
    for extra in (dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8_e4m3"), dict(num_layers=2, layer_windows=[0, 8])):
        with pytest.raises(ConfigError, match="neither FP8 blocks"):
            NodeConfig(**BASE, model_backend="torch", **extra).validate()
