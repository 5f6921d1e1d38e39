"""The GPU side of the tensor-parallel all-reduce: each rank's slots in device memory, shared
with the other ranks' processes by CUDA IPC handles (ipc/allreduce.py holds the counters, the
handle exchange through the node's shared memory and the algorithm; this is only what CuPy
must do). CUDA IPC works between processes on one GPU as between GPUs of one machine, so
`--tp 2` runs and is tested on a single-GPU machine; NCCL refuses two ranks on one device.

CuPy is imported only when a CUDA node's worker asks for it: kvrt imports and runs without it.
"""
from __future__ import annotations

from typing import Any

from kvrt.ipc.allreduce import PeerMemory

from kvrt.workers.backend import BackendUnavailable


class CudaPeerMemory(PeerMemory):
    """This rank's slots as one plain cudaMalloc on the current device (CUDA exports whole
    allocations, never a memory pool's sub-allocation), the peers' opened by IPC handle;
    the fence synchronises the current stream, where the model's kernels run."""

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as e:
            raise BackendUnavailable(f"a CUDA all-reduce needs CuPy (import failed: {e})") from None
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self._own: Any = None
        self._opened: list[int] = []

    @property
    def xp(self) -> Any:
        return self.cp

    def _array(self, mem: Any, nbytes: int) -> Any:
        return self.cp.ndarray((nbytes // 4,), self.cp.float32, self.cp.cuda.MemoryPointer(mem, 0))

    def allocate(self, nbytes: int) -> tuple[Any, bytes]:
        self._own = self.cp.cuda.Memory(nbytes)
        return self._array(self._own, nbytes), bytes(self.rt.ipcGetMemHandle(self._own.ptr))

    def open(self, handle: bytes, nbytes: int) -> Any:
        ptr = self.rt.ipcOpenMemHandle(handle)  # lazy peer access: a peer on another GPU is reachable
        self._opened.append(ptr)
        # the mapping is addressed from this rank's device (unified addressing), so CuPy's
        # kernels on it may read it as their own
        return self._array(self.cp.cuda.UnownedMemory(ptr, nbytes, None, self.rt.getDevice()), nbytes)

    def fence(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def close_peers(self) -> None:
        for ptr in self._opened:
            self.rt.ipcCloseMemHandle(ptr)
        self._opened = []

    def close(self) -> None:
        self.fence()
        self.close_peers()
        self._own = None


def peer_memory(device: str) -> PeerMemory | None:
    """Where a worker's all-reduce slots live on `device`: its own CUDA memory on "cuda", the
    node's shared-memory segment (None) on "cpu"."""
    return CudaPeerMemory() if device == "cuda" else None
