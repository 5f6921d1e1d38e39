import numpy as np
import pytest

from kvrt.ipc import protocol
from kvrt.ipc.ownership import OwnershipError, check_owners
from kvrt.ipc.registry import Registry
from kvrt.runtime.node.config import NodeConfig
from tests.conftest import run_py
from kvrt.workers.kv_pool import PoolError, PoolMaker, attach_pools, check_blocks, copy_blocks, pool_specs, shm_bytes_needed

ATTACH = """
import sys
import numpy as np
from kvrt.ipc.config import NodeConfig
from kvrt.ipc.registry import Registry
from kvrt.workers.kv_pool import attach_pools
reg = Registry.attach(sys.argv[1])
dev, host = attach_pools(reg, 1, NodeConfig.read(reg))
print(dev.array.shape, dev.array.dtype, float(dev.array[3].sum()), host.num_blocks)
host.array[5] = 7
dev.close(); host.close(); reg.close()
"""


def cfg(node: str, **kw) -> NodeConfig:
    base = dict(tp=2, num_gpu_blocks=16, num_cpu_blocks=8, num_layers=3, num_kv_heads=4, head_dim=8,
                block_size=4, dtype="float16")
    return NodeConfig(node=node, **{**base, **kw}).validate()


def test_shapes_and_sizes_follow_the_config(node):
    c = cfg(node)
    assert c.block_shape == c.kv_layout.block_shape == (3, 2, 4, 2, 8)
    assert c.block_bytes == 3 * 2 * 4 * 2 * 8 * 2
    specs = pool_specs(c)
    assert [(s.rank, s.tier, s.obj) for s in specs] == [
        (0, "device", "pool.device.0"), (0, "host", "pool.host.0"),
        (1, "device", "pool.device.1"), (1, "host", "pool.host.1")]
    assert specs[1].shape == (8, 3, 2, 4, 2, 8)
    assert shm_bytes_needed(c) == 2 * (16 + 8) * c.block_bytes
    assert shm_bytes_needed(cfg(node, num_cpu_blocks=0)) == 2 * 16 * c.block_bytes
    # on a GPU machine only the host pools live in /dev/shm
    assert shm_bytes_needed(cfg(node, device="cuda")) == 2 * 8 * c.block_bytes


@pytest.mark.e2e
def test_create_registers_prefaulted_pools_and_children_attach(node):
    c = cfg(node)
    lines = []
    maker = PoolMaker()
    assert maker.bytes_needed(c) == shm_bytes_needed(c)
    with Registry.create(node) as reg:
        protocol.publish_config(reg, c.to_dict())
        maker.create(reg, c, lines.append)
        assert len(lines) == 4 and "pool.host.1: 8 blocks x 768 B = 6.0 KiB (/dev/shm, pre-faulted)" in lines[3]
        info = reg.find(protocol.host_pool(1))
        assert (info.kind, info.dtype, info.shape) == ("pool", "<f2", (8, 3, 2, 4, 2, 8))
        assert info.meta == {"backend": "numpy", "tier": "host", "rank": 1}
        dev, host = attach_pools(reg, 1, c)
        dev.array[3] = 1.5
        r = run_py(ATTACH, node)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["(16,", "3,", "2,", "4,", "2,", "8)", "float16", str(1.5 * 384), "8"]
        assert (host.array[5] == 7).all() and not host.array[4].any()
        dev.close()
        host.close()
        assert attach_pools(reg, 0, cfg(node, num_cpu_blocks=0))[1] is None


def test_copy_checks_ids_and_beats_per_batch(node, monkeypatch):
    c = cfg(node, tp=1, num_gpu_blocks=32, num_cpu_blocks=32)
    with Registry.create(node) as reg:
        PoolMaker().create(reg, c, lambda line: None)
        dev, host = attach_pools(reg, 0, c)
        dev.array[:] = np.arange(32, dtype=np.float16)[:, None, None, None, None, None]
        with pytest.raises(PoolError, match=r"block id 32 out of range 0..31"):
            copy_blocks(host, dev, [0, 1], [5, 32])
        with pytest.raises(PoolError, match=r"block id -1 out of range"):
            copy_blocks(host, dev, [-1], [5])
        assert not host.array.any()  # a refused order copies nothing
        beats = []
        monkeypatch.setattr("kvrt.workers.kv_pool.BEAT_BYTES", 4 * dev.block_bytes)
        src = np.arange(32)[::-1]  # no two pairs form a run: 32 single-block copies
        copy_blocks(host, dev, np.arange(32), src, beat=lambda: beats.append(1))
        assert len(beats) == 8
        assert np.array_equal(host.array[:, 0, 0, 0, 0, 0], src.astype(np.float16))
        dev.close()
        host.close()


def test_check_blocks_and_owners():
    assert check_blocks(np.array([0, 3], np.int32), 4, "device").dtype == np.int64
    owners = np.full(8, protocol.OWNER_TRANSFER, np.int32)
    check_owners(owners, np.array([1, 2]), "device", "task 1", protocol.OWNER_TRANSFER)
    owners[[2, 5]] = protocol.OWNER_WORKER
    with pytest.raises(OwnershipError) as e:
        check_owners(owners, np.array([1, 2, 5]), "device", "task 9 (swap2cpu)", protocol.OWNER_TRANSFER)
    msg = str(e.value)
    assert "task 9 (swap2cpu)" in msg and "device block 2 is owned by worker, not cache-transfer" in msg
    assert "2 of 3 blocks wrong: [2, 5]" in msg


class _LateCopies:
    """A device whose copies land after a few `is_done` polls; `wait` notes whether its mark
    had landed by then (a blocking wait on a GPU would have slept past the end of the copy)."""

    def __init__(self, polls: int) -> None:
        self.polls, self.asked, self.waited_done = polls, 0, []

    def is_done(self, mark) -> bool:
        self.asked += 1
        return self.asked >= self.polls

    def wait(self, mark) -> None:
        self.waited_done.append(self.asked >= self.polls)


@pytest.mark.parametrize("spin_s, polled", [(60.0, True), (0.0, False)])
def test_a_copy_wait_polls_its_event_first(spin_s, polled):
    """With a spin (a GPU node's --wait-spin-us), the task's wait polls the copy's event until it
    landed and only then waits (at once); without one it goes straight to the blocking wait."""
    from kvrt.workers.kv_pool import CopyJob

    dev = _LateCopies(polls=5)
    beats = []
    assert CopyJob(dev, ["mark"], 1, 4096).wait(lambda: beats.append(1), spin_s) == 4096
    assert dev.waited_done == [polled] and beats == [1]
    assert dev.asked == (5 if polled else 0)


def test_wait_spin_is_a_gpu_nodes_by_default():
    """auto: a GPU node's waits spin (cores to spare), a CPU node's do not (the worker needs its core)."""
    assert NodeConfig(node="n", device="cuda").wait_spin_s == 250e-6
    assert NodeConfig(node="n").wait_spin_s == 0.0
    assert NodeConfig(node="n", wait_spin_us=40).wait_spin_s == 40e-6
