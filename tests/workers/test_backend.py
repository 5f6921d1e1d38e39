import contextlib
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kvrt.ipc.errors import IpcError
from kvrt.ipc.registry import Registry
from tests.conftest import REPO
from kvrt.workers.backend import BackendUnavailable, CupyBackend, NumpyBackend, create_shm_pool, get_backend
from kvrt.workers.kv_pool import coalesce, copy_blocks

SHAPE = (2, 2, 4, 2, 8)  # a block: layers, K/V, block_size, heads, head_dim


def test_coalesce_merges_only_pairs_advancing_together():
    assert coalesce([], []) == []
    assert coalesce([5], [9]) == [(5, 9, 1)]
    # 3,4,5 -> 10,11,12 is one run; 6 -> 20 breaks (dst jumps); 7 -> 21 continues from 6 -> 20
    assert coalesce([3, 4, 5, 6, 7, 0], [10, 11, 12, 20, 21, 2]) == [(3, 10, 3), (6, 20, 2), (0, 2, 1)]
    # src consecutive but dst not, and the reverse: no merging
    assert coalesce([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]
    assert coalesce([2, 1], [4, 5]) == [(2, 4, 1), (1, 5, 1)]
    with pytest.raises(ValueError, match="pairs 2 source blocks with 1"):
        coalesce([1, 2], [3])


def test_numpy_copies_equal_fancy_indexing(node):
    rng = np.random.default_rng(1)
    with Registry.create(node) as reg:
        for obj in ("dev", "host"):
            create_shm_pool(reg, obj, (64, *SHAPE), "float32", {"backend": "numpy"})
        b = NumpyBackend()
        dev, host = b.open_device_pool(reg, "dev"), b.open_host_pool(reg, "host")
        assert dev.on_device and not host.on_device and dev.backend is b
        assert (dev.num_blocks, dev.block_bytes) == (64, int(np.prod(SHAPE)) * 4)
        assert not dev.array.any()  # a fresh pool is zeroed
        dev.array[:] = rng.random(dev.array.shape, dtype=np.float32)
        src = np.concatenate([np.arange(10, 18), rng.choice(np.arange(20, 64), 20, replace=False)])
        dst = np.concatenate([np.arange(40, 48), rng.choice(40, 20, replace=False)])
        expect = host.array.copy()
        expect[dst] = dev.array[src]
        assert copy_blocks(host, dev, dst, src) == len(src) * dev.block_bytes
        assert np.array_equal(host.array, expect)
        dev.close()
        host.close()


def test_open_refuses_a_non_pool(node):
    with Registry.create(node) as reg:
        reg.create_segment("plain", 4096).close()
        with pytest.raises(IpcError, match="not a pool"):
            NumpyBackend().open_host_pool(reg, "plain")


@pytest.mark.e2e
def test_backend_choice_and_cupy_is_optional():
    assert isinstance(get_backend("cpu"), NumpyBackend)
    with pytest.raises(ValueError, match="unknown device"):
        get_backend("tpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match=r"kvrt\[gpu\]"):
            get_backend("cuda")
    # importing the worker side never imports CuPy (it is loaded only for device=cuda)
    code = ("import sys, kvrt.workers.backend, kvrt.workers.kv_pool, kvrt.workers.cache_transfer; "
            "print('cupy' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_cupy_device_pool_is_zeroed_before_its_handle_is_published(node):
    """cudaMemset of device memory may return before it lands, and the process that opens the
    pool's IPC handle is ordered with nothing in the creator's context: the creator must wait
    for the zeros before it publishes the handle. CUDA runtime stand-in: calls are logged."""
    log: list = []

    class Runtime:
        def getDeviceCount(self) -> int:  # noqa: N802 (CUDA's names)
            return 1

        def memGetInfo(self) -> tuple[int, int]:  # noqa: N802
            return 1 << 30, 1 << 30

        def memset(self, ptr: int, value: int, nbytes: int) -> None:
            log.append("memset")

        def deviceSynchronize(self) -> None:  # noqa: N802
            log.append("synchronize")

        def ipcGetMemHandle(self, ptr: int) -> bytes:  # noqa: N802
            return bytes(range(64))

    b = CupyBackend.__new__(CupyBackend)
    b.rt = Runtime()
    b.cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext(),
                                                Memory=lambda n: SimpleNamespace(ptr=1 << 20, size=n)))
    with Registry.create(node) as reg:
        create = reg.create_segment

        def publish(*args, **kwargs):
            log.append("publish")
            return create(*args, **kwargs)

        reg.create_segment = publish
        mem = b.create_device_pool(reg, "pool", (4, *SHAPE), "float16", 0)
        assert mem.size == 4 * int(np.prod(SHAPE)) * 2
        assert log == ["memset", "synchronize", "publish"]
