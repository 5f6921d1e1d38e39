"""The shared-memory all-reduce between real processes: exact sums, bit-identical on every
rank, over many generations (both buffers reused); a missing rank is a named timeout; and a
checkpoint split over two ranks through it gives the dense reference's logits. The same for
its peer-memory mode (each rank's slots its own, exported by handle: a GPU node's CUDA IPC
buffers), with shared-memory segments standing in for the device buffers
(tests/shm_peer_memory.py)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvrt.ipc.allreduce import AllReduce
from kvrt.ipc.errors import WaitTimeout
from kvrt.ipc.registry import Registry
from tests.conftest import spawn_py
from tests.hfkit import VOCAB, dense_logits, make_checkpoint

RANK = """
import sys
import numpy as np
from kvrt.ipc.allreduce import AllReduce
from kvrt.ipc.registry import Registry
reg = Registry.attach(sys.argv[1])
rank, tp, rounds = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
memory = None
if sys.argv[5] == "peer":
    from tests.shm_peer_memory import ShmPeerMemory
    memory = ShmPeerMemory(reg.node, rank)
ar = AllReduce.attach(reg, "ar", rank, timeout=30, memory=memory)
digest = 0.0
for g in range(rounds):
    n = 1 + (g * 37) % 500
    x = np.random.default_rng([g, rank]).standard_normal(n).astype(np.float32)
    s = ar.sum(x)
    want = sum(np.random.default_rng([g, r]).standard_normal(n).astype(np.float32) for r in range(tp))
    assert np.allclose(s, want, rtol=1e-5, atol=1e-5), g
    digest += float(s.astype(np.float64) @ np.arange(n))
assert memory is None or memory.fences == rounds, "one fence before each publication"
ar.close()
print(repr(digest))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["host", "peer"])
def test_sums_across_processes_identical_on_every_rank(node, mode):
    tp, rounds = 3, 300
    with Registry.create(node) as reg:
        AllReduce.create(reg, "ar", tp, 512, peer_memory=mode == "peer")
        procs = [spawn_py(RANK, node, str(r), str(tp), str(rounds), mode) for r in range(tp)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(out.strip())
        assert len(set(outs)) == 1, f"ranks disagree: {outs}"


def test_a_missing_rank_is_a_named_timeout(node):
    with Registry.create(node) as reg:
        AllReduce.create(reg, "ar", 2, 8)
        ar = AllReduce.attach(reg, "ar", 0, timeout=0.2)
        with pytest.raises(WaitTimeout, match=r"rank\(s\) \[1\]"):
            ar.sum(np.ones(4, np.float32))
        with pytest.raises(ValueError, match="capacity"):
            ar.sum(np.ones(9, np.float32))
        ar.close()


def test_a_rank_that_never_posts_its_buffers_is_a_named_timeout(node):
    from tests.shm_peer_memory import ShmPeerMemory

    with Registry.create(node) as reg:
        AllReduce.create(reg, "ar", 3, 8, peer_memory=True)
        ar0 = AllReduce.attach(reg, "ar", 0, timeout=0.2, memory=ShmPeerMemory(node, 0))
        ar2 = AllReduce.attach(reg, "ar", 2, timeout=0.2, memory=ShmPeerMemory(node, 2))
        with pytest.raises(WaitTimeout, match=r"rank\(s\) \[1\] to post their buffers' handles"):
            ar0.sum(np.ones(4, np.float32))
        ar0.close()
        ar2.close()


def test_slots_must_be_where_the_segment_says(node):
    """A GPU node's segment holds handles, a CPU node's holds the slots: a rank attaching the
    other way would meet no one, so it is refused."""
    from kvrt.ipc.errors import IpcError
    from tests.shm_peer_memory import ShmPeerMemory

    with Registry.create(node) as reg:
        AllReduce.create(reg, "peer", 2, 8, peer_memory=True)
        AllReduce.create(reg, "host", 2, 8)
        with pytest.raises(IpcError, match="without peer memory"):
            AllReduce.attach(reg, "peer", 0, timeout=1)
        with pytest.raises(IpcError, match="with peer memory"):
            AllReduce.attach(reg, "host", 0, timeout=1, memory=ShmPeerMemory(node, 0))


@pytest.mark.parametrize("mode", ["host", "peer"])
def test_two_rank_split_equals_dense_reference(node, tmp_path, mode):
    """Each rank holds half the heads and MLP width; summed through the all-reduce, both ranks'
    logits equal the unsplit dense reference."""
    from kvrt.workers.model.checkpoint import inspect
    from kvrt.workers.model.hf_model import HFModel
    from kvrt.workers.model.transformer import SeqInput

    ck = make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16", num_attention_heads=4, num_key_value_heads=2)
    toks = np.random.default_rng(2).integers(0, VOCAB, 21).astype(np.int32)
    want = dense_logits(ck, toks)
    got: dict[int, list] = {}
    with Registry.create(node) as reg:
        from tests.shm_peer_memory import ShmPeerMemory

        AllReduce.create(reg, "ar", 2, 64 * 32, peer_memory=mode == "peer")
        ars = [AllReduce.attach(reg, "ar", r, timeout=30, memory=ShmPeerMemory(node, r) if mode == "peer" else None)
               for r in range(2)]

        def rank(r: int) -> None:
            model = HFModel(inspect(ck.path), 512, rank=r, tp=2, allreduce=ars[r].sum)
            pool = np.zeros(model.shape.kv_layout(8, "float32").pool_shape(8), np.float32)
            table = np.array([3, 1, 4], np.int32)
            got[r] = [model.step_logits(pool, [SeqInput(toks[:13], 0, table)])[0],
                      model.step_logits(pool, [SeqInput(toks[13:], 13, table)])[0]]
            ars[r].close()  # as a worker process does: peer memory's ranks close together

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert set(got) == {0, 1}
    assert np.array_equal(got[0][1], got[1][1]), "every rank computes identical logits"
    for first, last in got.values():
        np.testing.assert_allclose(first, want[12], rtol=1e-4, atol=1e-4 * np.abs(want).max())
        np.testing.assert_allclose(last, want[20], rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_a_split_models_warm_up_waits_for_no_other_rank(tmp_path):
    """A GPU worker warms up (CuPy compiles its kernels) before it says ready, while the other
    ranks may still be loading the checkpoint: the warm-up step must not wait on an all-reduce
    (a rank's wait is only --rank-timeout), and leaves the model's all-reduce in place."""
    from kvrt.workers.model.checkpoint import inspect
    from kvrt.workers.model.hf_model import HFModel

    def nobody_else_here(partial):
        raise WaitTimeout("all-reduce: rank 0 waited for rank(s) [1]")

    ck = make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16", num_attention_heads=4, num_key_value_heads=2)
    model = HFModel(inspect(ck.path), 512, rank=0, tp=2, allreduce=nobody_else_here)
    model.warm_up(8)
    assert model.allreduce is nobody_else_here


def test_room_check_counts_the_allreduce():
    from kvrt.ipc.allreduce import segment_bytes
    from kvrt.runtime.node.config import NodeConfig
    from kvrt.runtime.node.supervisor import shm_needs

    base = dict(node="n", tp=2, max_num_batched_tokens=64)
    plain = shm_needs(NodeConfig(**base), 0)["signals"]
    split = NodeConfig(**base, model_dir="/m", model_arch="LlamaForCausalLM", model_fingerprint="f", hidden_size=1024)
    assert shm_needs(split, 0)["signals"] - plain >= segment_bytes(2, 64 * 1024)


def test_a_damaged_handle_entry_is_refused(node):
    """The handle table is shared memory any rank's process can scribble on: a length that does
    not fit its entry is refused, never read past the entry."""
    from kvrt.ipc._atomic import Region
    from kvrt.ipc.errors import IpcError
    from kvrt.ipc.shm import Segment
    from tests.shm_peer_memory import ShmPeerMemory

    with Registry.create(node) as reg:
        AllReduce.create(reg, "ar", 2, 8, peer_memory=True)
        ar = AllReduce.attach(reg, "ar", 0, timeout=1, memory=ShmPeerMemory(node, 0))
        seg = Segment.attach(reg.find("ar").name)
        region = Region(seg.mm)
        for bad in (-8, 1 << 20):
            region.store64(2 * 64 + 256, bad)  # rank 1's entry, after the two counters
            with pytest.raises(IpcError, match="rank 1 posted a handle of"):
                ar.sum(np.ones(4, np.float32))
        region.release()
        seg.close()
        ar.close()
