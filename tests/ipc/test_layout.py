"""One KV layout spec (ipc/layout.py) and one typed node config (ipc/config.py): the pools, the
model, the transports and the launcher's sizing all derive a block from the same spec."""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.ipc import protocol
from kvrt.ipc.config import NodeConfig as SharedConfig
from kvrt.ipc.layout import KVLayout
from kvrt.ipc.registry import Registry
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.node.supervisor import shm_needs
from tests.conftest import run_py
from kvrt.workers.kv_pool import PoolError, PoolMaker, attach_pools, pool_specs
from kvrt.workers.model.transformer import ModelShape
from kvrt.workers.transports.base import array_layout


def small(node: str, **kw) -> NodeConfig:
    base = dict(tp=2, num_gpu_blocks=6, num_cpu_blocks=4, num_layers=3, num_kv_heads=4, head_dim=8,
                block_size=4, dtype="float16")
    return NodeConfig(node=node, **{**base, **kw}).validate()


def test_a_rank_holds_its_share_of_the_heads_block_major():
    layout = KVLayout.of_node(num_layers=3, block_size=4, num_kv_heads=4, head_dim=8, dtype="float16", tp=2)
    assert layout.block_shape == (3, 2, 4, 2, 8)
    assert layout.block_bytes == 3 * 2 * 4 * 2 * 8 * 2
    assert layout.pool_shape(5) == (5, 3, 2, 4, 2, 8) and layout.pool_bytes(5) == 5 * layout.block_bytes
    pool = np.zeros(layout.pool_shape(5), np.float16)
    view = layout.layer(pool, 1)
    assert view.shape == (5, 2, 4, 2, 8) and np.shares_memory(view, pool)
    assert KVLayout.of_pool_shape(pool.shape, pool.dtype) == layout
    with pytest.raises(ValueError, match="divide num_kv_heads 3"):
        KVLayout.of_node(3, 4, 3, 8, "float16", tp=2)
    with pytest.raises(ValueError, match="a KV pool is"):
        KVLayout.of_pool_shape((5, 3, 4, 2, 8), np.float16)


def test_pools_model_transport_and_sizing_derive_from_one_spec(node):
    cfg = small(node)
    layout = cfg.kv_layout
    assert cfg.block_shape == layout.block_shape and cfg.block_bytes == layout.block_bytes
    assert {s.shape for s in pool_specs(cfg)} == {layout.pool_shape(6), layout.pool_shape(4)}
    assert ModelShape.from_config(cfg).kv_layout(cfg.block_size, cfg.dtype) == layout
    assert array_layout(layout.pool_shape(6), layout.dtype)["block_bytes"] == layout.block_bytes
    assert shm_needs(cfg, PoolMaker().bytes_needed(cfg))["KV pools"] == 2 * (6 + 4) * layout.block_bytes


def test_a_pool_of_another_layout_is_refused_on_attach(node):
    cfg = small(node)
    with Registry.create(node) as reg:
        PoolMaker().create(reg, cfg, lambda line: None)
        with pytest.raises(PoolError, match=r"pool.device.0 holds blocks of .* \(head_dim 8 instead of 16\)"):
            attach_pools(reg, 0, small(node, head_dim=16))
        dev, host = attach_pools(reg, 0, cfg)
        dev.close()
        host.close()


READ = """
import sys
from kvrt.ipc.config import NodeConfig
from kvrt.ipc.registry import Registry
reg = Registry.attach(sys.argv[1])
cfg = NodeConfig.read(reg)
print(type(cfg).__module__, cfg.tp, cfg.needs_transfer, cfg.kv_layout)
reg.close()
"""


@pytest.mark.e2e
def test_a_child_reads_the_published_config_as_the_typed_object(node):
    cfg = small(node)
    assert isinstance(cfg, SharedConfig)
    with Registry.create(node) as reg:
        protocol.publish_config(reg, {**cfg.to_dict(), "a_field_of_a_newer_build": 1})
        r = run_py(READ, node)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["kvrt.ipc.config", "2", "True", "[3x2x4x2x8]", "float16"]
