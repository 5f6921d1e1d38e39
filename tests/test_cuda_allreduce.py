"""workers/cuda_allreduce.py's glue, run on a CPU: a stand-in `cupy` module (device memory as
host buffers, an IPC handle as the allocation's address) checks what the CUDA all-reduce asks
of CuPy: one plain allocation per rank, its handle posted, every peer's handle opened once and
closed at the end, a stream synchronisation before each publication. The real thing runs on a
GPU in tests/test_gpu_model.py."""
from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

from ipc.allreduce import AllReduce
from ipc.registry import Registry


class _Runtime:
    """The few CUDA runtime calls the module makes, over host buffers."""

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray] = {}
        self.opened: list[int] = []
        self.closed: list[int] = []

    def ipcGetMemHandle(self, ptr: int) -> bytes:  # noqa: N802 (CUDA's name)
        assert ptr in self.buffers, "only a whole allocation can be exported"
        return ptr.to_bytes(64, "little")

    def ipcOpenMemHandle(self, handle: bytes) -> int:  # noqa: N802
        ptr = int.from_bytes(handle, "little")
        self.opened.append(ptr)
        return ptr

    def ipcCloseMemHandle(self, ptr: int) -> None:  # noqa: N802
        self.closed.append(ptr)

    def getDevice(self) -> int:  # noqa: N802
        return 0


def fake_cupy(rt: _Runtime, syncs: list) -> types.ModuleType:
    cp = types.ModuleType("cupy")

    class Memory:
        def __init__(self, nbytes: int) -> None:
            buf = np.zeros(nbytes, np.uint8)
            self.ptr = buf.ctypes.data
            rt.buffers[self.ptr] = buf

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner, device_id: int) -> None:
            assert device_id == 0 and size <= rt.buffers[ptr].nbytes
            self.ptr = ptr

    class MemoryPointer:
        def __init__(self, mem, offset: int) -> None:
            self.mem, self.offset = mem, offset

    class Stream:
        def synchronize(self) -> None:
            syncs.append(threading.get_ident())

    def ndarray(shape, dtype, memptr):
        buf = rt.buffers[memptr.mem.ptr]
        return np.frombuffer(buf, dtype, int(np.prod(shape)), memptr.offset).reshape(shape)

    cp.cuda = types.SimpleNamespace(runtime=rt, Memory=Memory, UnownedMemory=UnownedMemory,
                                    MemoryPointer=MemoryPointer, get_current_stream=Stream)
    cp.ndarray, cp.float32, cp.asarray = ndarray, np.float32, np.asarray
    return cp


def test_cuda_peer_memory_glue(node, monkeypatch):
    rt, syncs = _Runtime(), []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(rt, syncs))
    from workers.cuda_allreduce import CudaPeerMemory, peer_memory

    assert peer_memory("cpu") is None
    tp, rounds = 3, 20
    results: dict[int, list] = {}
    with Registry.create(node) as reg:
        AllReduce.create(reg, "ar", tp, 64, peer_memory=True)
        ars = [AllReduce.attach(reg, "ar", r, timeout=30, memory=peer_memory("cuda")) for r in range(tp)]
        assert all(isinstance(a._memory, CudaPeerMemory) for a in ars)
        assert len(rt.buffers) == tp, "one allocation per rank"

        def rank(r: int) -> None:
            results[r] = [ars[r].sum(np.full(1 + g, r + g, np.float32)) for g in range(rounds)]

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for a in ars:
            a.close()
    for r in range(tp):
        assert [x.tolist() for x in results[r]] == [[float(sum(q + g for q in range(tp)))] * (1 + g)
                                                    for g in range(rounds)]
    assert sorted(rt.opened) == sorted(rt.closed) and len(rt.opened) == tp * (tp - 1), \
        "each rank opens every peer's handle once, and closes it"
    assert len(syncs) >= tp * rounds, "a stream synchronisation before every publication"


def test_without_cupy_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    from workers.backend import BackendUnavailable
    from workers.cuda_allreduce import peer_memory

    with pytest.raises(BackendUnavailable, match="CuPy"):
        peer_memory("cuda")
