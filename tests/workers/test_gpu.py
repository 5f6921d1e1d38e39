"""The CuPy path (device pool = one cudaMalloc shared by CUDA IPC handle, pinned host pool,
copies on a stream). Skipped where CuPy or a GPU is missing; run on a GPU machine."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvrt.ipc import protocol
from kvrt.ipc.protocol import PROTOCOL, TransferTask
from tests.conftest import REPO, leftovers, run_py
from tests.nodekit import NodeKit
from kvrt.workers.backend import NumpyBackend
from tests.gpukit import cuda_cupy

cupy = cuda_cupy()
pytestmark = pytest.mark.e2e

# The "worker": opens the rank's device pool by IPC handle (CUDA refuses to open a handle in
# the process that exported it, so this must be another process), then fills or checksums.
WORKER = """
import sys
import cupy, numpy as np, xxhash
from kvrt.ipc import protocol
from kvrt.ipc.config import NodeConfig
from kvrt.ipc.registry import Registry
from kvrt.workers.kv_pool import attach_pools
reg = Registry.attach(sys.argv[1])
dev, host = attach_pools(reg, 0, NodeConfig.read(reg))
assert isinstance(dev.array, cupy.ndarray) and dev.on_device and not host.on_device
blocks = [int(b) for b in sys.argv[3].split(",")]
if sys.argv[2] == "fill":
    dev.array[:] = cupy.random.default_rng(1).random(dev.array.shape, dtype=cupy.float32)
elif sys.argv[2] == "zero":
    dev.array[:] = 0
cupy.cuda.runtime.deviceSynchronize()
print(",".join(str(xxhash.xxh3_64_intdigest(cupy.asnumpy(dev.array[b]).tobytes())) for b in blocks))
dev.close(); host.close(); reg.close()
"""


def worker(node: str, action: str, blocks) -> list[int]:
    r = run_py(WORKER, node, action, ",".join(map(str, blocks)))
    assert r.returncode == 0, r.stderr
    return [int(x) for x in r.stdout.strip().split(",")]


def host_sums(kit: NodeKit, blocks) -> list[int]:
    import xxhash

    host = NumpyBackend().open_host_pool(kit.reg, protocol.host_pool(0))
    try:
        return [xxhash.xxh3_64_intdigest(host.array[b].tobytes()) for b in blocks]
    finally:
        host.close()


def test_cuda_swap_and_storage_through_cache_transfer(node, tmp_path):
    store = tmp_path / "store"
    with NodeKit.create(node, tmp_path, tp=1, device="cuda", num_cpu_blocks=32, storage=f"file:{store}") as kit:
        assert kit.reg.find(protocol.device_pool(0)).meta["backend"] == "cupy"
        kit.start_transfer()
        dev = [2, 3, 4, 5, 17, 9, 40]
        host = [10, 11, 12, 13, 1, 30, 0]
        before = worker(kit.reg.node, "fill", dev)
        (a,) = kit.request(TransferTask(1, protocol.SWAP2CPU, np.array(dev, np.int32), np.array(host, np.int32)))
        assert a.ok and a.blocks == len(dev), a
        assert host_sums(kit, host) == before
        worker(kit.reg.node, "zero", dev)
        back = [50, 51, 52, 53, 60, 7, 8]
        (a,) = kit.request(TransferTask(2, protocol.SWAP2GPU, np.array(back, np.int32), np.array(host, np.int32)))
        assert a.ok, a
        assert worker(kit.reg.node, "sums", back) == before
        keys = [os.urandom(16) for _ in back]
        none = np.array([], np.int32)
        (a,) = kit.request(TransferTask(3, protocol.GPU2STORAGE, np.array(back, np.int32), none, keys))
        assert a.ok and a.blocks == len(back) and a.nbytes > 0, a
        worker(kit.reg.node, "zero", back)
        (a,) = kit.request(TransferTask(4, protocol.STORAGE2GPU, np.array(dev, np.int32), none, keys))
        assert a.ok and a.blocks == len(dev), a
        assert worker(kit.reg.node, "sums", dev) == before


def test_cuda_burst_of_queued_swaps_lands_in_order(node, tmp_path):
    """Tasks sent back to back are taken together and their copies queued on the stream before
    the first is answered; each depends on the one before (out to host, back to another device
    block), so an answer sent before its bytes landed, or copies out of order, shows here."""
    with NodeKit.create(node, tmp_path, tp=1, device="cuda", num_cpu_blocks=32) as kit:
        kit.start_transfer()
        before = worker(kit.reg.node, "fill", range(16))
        tasks = []
        for i in range(16):
            tasks.append(TransferTask(2 * i + 1, protocol.SWAP2CPU, np.array([i], np.int32), np.array([i], np.int32)))
            tasks.append(TransferTask(2 * i + 2, protocol.SWAP2GPU, np.array([32 + i], np.int32),
                                      np.array([i], np.int32)))
        out, answers = kit.ends(0)
        for t in tasks:
            out.put(PROTOCOL.encode(t), 5.0)
        got = [PROTOCOL.decode(answers.get(20.0)) for _ in tasks]
        assert [(a.task_id, a.ok, a.blocks) for a in got] == [(t.task_id, True, 1) for t in tasks], got
        assert host_sums(kit, range(16)) == before
        assert worker(kit.reg.node, "sums", range(32, 48)) == before


def test_bench_copy_on_cuda_quick():
    """`kvrt bench copy --device cuda`, small: every row, the device pool in GPU memory."""
    bench = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "bench", "copy", "--device", "cuda", "--json",
                              "--pool-blocks", "64", "--blocks", "32", "--tasks", "20", "--e2e-blocks", "1,8",
                              "--num-layers", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = bench.communicate(timeout=300)
    assert bench.returncode == 0, err
    assert not leftovers(f"benchcopy{bench.pid}")
    report = json.loads(out)
    assert report["device"] == "cuda"
    rows = report["rows"]
    assert [(x["case"], x["blocks"]) for x in rows] == [
        ("limit h2d", 32), ("limit d2h", 32), ("loop h2d", 32), ("loop d2h", 32), ("swap2gpu", 32),
        ("swap2cpu", 32), ("e2e swap2cpu", 1), ("e2e swap2gpu", 1), ("e2e swap2cpu", 8),
        ("e2e swap2gpu", 8), ("e2e burst", 1)]
    assert all(x["gb_s"] > 0 and x["vs_limit"] > 0 for x in rows)
