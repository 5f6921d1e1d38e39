"""workers/cuda_allreduce.py's glue, run on a CPU: a stand-in `cupy` module (device memory as
host buffers, an IPC handle as the allocation's address) checks what the CUDA all-reduce asks
of CuPy: one plain allocation per rank, its handle posted, every peer's handle opened once and
closed at the end, a stream synchronisation before each publication. The real thing runs on a
GPU in tests/workers/model/test_gpu_model.py."""
from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

from kvrt.ipc.allreduce import AllReduce
from kvrt.ipc.registry import Registry


class _Runtime:
    """The few CUDA runtime calls the module makes, over host buffers; `events` logs each
    handle closed and each allocation freed, in order."""

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray] = {}
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.events: list[tuple[str, int]] = []

    def ipcGetMemHandle(self, ptr: int) -> bytes:  # noqa: N802 (CUDA's name)
        assert ptr in self.buffers, "only a whole allocation can be exported"
        return ptr.to_bytes(64, "little")

    def ipcOpenMemHandle(self, handle: bytes) -> int:  # noqa: N802
        ptr = int.from_bytes(handle, "little")
        self.opened.append(ptr)
        return ptr

    def ipcCloseMemHandle(self, ptr: int) -> None:  # noqa: N802
        self.closed.append(ptr)
        self.events.append(("close", ptr))

    def getDevice(self) -> int:  # noqa: N802
        return 0


def fake_cupy(rt: _Runtime, syncs: list) -> types.ModuleType:
    cp = types.ModuleType("cupy")

    class Memory:
        def __init__(self, nbytes: int) -> None:
            buf = np.zeros(nbytes, np.uint8)
            self.ptr = buf.ctypes.data
            rt.buffers[self.ptr] = buf

        def __del__(self) -> None:  # cupy.cuda.Memory's cudaFree
            rt.events.append(("free", self.ptr))

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
    from kvrt.workers.cuda_allreduce import CudaPeerMemory, peer_memory

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
            ars[r].close()  # as a worker process does: the ranks close together

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for r in range(tp):
        assert [x.tolist() for x in results[r]] == [[float(sum(q + g for q in range(tp)))] * (1 + g)
                                                    for g in range(rounds)]
    assert sorted(rt.opened) == sorted(rt.closed) and len(rt.opened) == tp * (tp - 1), \
        "each rank opens every peer's handle once, and closes it"
    assert len(syncs) >= tp * rounds, "a stream synchronisation before every publication"


def test_a_rank_frees_its_slots_only_after_every_peer_closed_its_handle(node, monkeypatch):
    """A rank done with its last sum may return while a peer is still about to read that
    generation from its slots, and CUDA leaves undefined an exporter freeing memory an importer
    has not closed: a rank's close waits until every peer closed its handle to its slots."""
    rt, syncs = _Runtime(), []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(rt, syncs))
    from kvrt.workers.cuda_allreduce import peer_memory

    with Registry.create(node) as reg:
        AllReduce.create(reg, "ar", 2, 16, peer_memory=True)
        ars = [AllReduce.attach(reg, "ar", r, timeout=30, memory=peer_memory("cuda")) for r in range(2)]
        own = [a._memory._own.ptr for a in ars]
        peer = threading.Thread(target=ars[1].sum, args=(np.ones(4, np.float32),))
        peer.start()
        ars[0].sum(np.ones(4, np.float32))
        peer.join(30)
        first = threading.Thread(target=ars[0].close)  # rank 1 still holds rank 0's slots open
        first.start()
        first.join(1.0)
        assert ("free", own[0]) not in rt.events, "rank 0 freed its slots while rank 1 had them open"
        ars[1].close()
        first.join(30)
    assert not first.is_alive()
    for p in own:  # every close of a handle to an allocation comes before its free
        closes = [i for i, e in enumerate(rt.events) if e == ("close", p)]
        assert closes and rt.events.index(("free", p)) > max(closes), rt.events


def test_without_cupy_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    from kvrt.workers.backend import BackendUnavailable
    from kvrt.workers.cuda_allreduce import peer_memory

    with pytest.raises(BackendUnavailable, match="CuPy"):
        peer_memory("cuda")
