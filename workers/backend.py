"""Array backends: the one place that knows whether a KV pool lives in host shared memory
(numpy) or in GPU memory (CuPy), so the rest of workers/ has one code path.

A backend allocates and opens a rank's device pool, opens its host pool, and copies runs of
blocks between pools. Pools are block-major, so a run of n consecutive blocks is one contiguous
byte range in both pools: one `np.copyto` on a CPU machine, one `cudaMemcpyAsync` on a GPU
machine. Fancy indexing (`host[dst] = dev[src]`) gathers into a temporary first and measured
2-3x slower, so it is never used.

CuPy is imported only when the cuda backend is asked for: kvrt imports and runs without it.
"""
from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kvrt.ipc.errors import IpcError
from kvrt.ipc.registry import Registry
from kvrt.ipc.shm import Segment

Run = tuple[int, int, int]  # (first source block, first destination block, block count)
_HANDLE_LEN = 8  # length prefix of the CUDA IPC handle stored in a device pool's segment
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python 3.13 names it
# CUDA runtime ABI constants (stable across releases; not every CuPy build exports them)
_MEMCPY_DEFAULT, _HOST_REGISTER_PORTABLE, _STREAM_NON_BLOCKING = 4, 1, 1
_EVENT_DISABLE_TIMING, _SUCCESS = 2, 0


class BackendUnavailable(RuntimeError):
    """The configured device needs a library or a device this machine does not have."""


class DeviceMemoryError(RuntimeError):
    """A device pool would not fit in the GPU's free memory: the message names both."""


@dataclass
class Pool:
    """One rank's KV pool in one tier, `[num_blocks, *block_shape]`, opened in this process.

    `array` is a numpy or a cupy array; `release` undoes what opening did (unmap, unpin,
    close the IPC mapping). Pools are opened only through a backend."""

    name: str
    array: Any
    backend: "ArrayBackend"
    on_device: bool
    release: Callable[[], None]

    @property
    def num_blocks(self) -> int:
        return int(self.array.shape[0])

    @property
    def block_bytes(self) -> int:
        return int(self.array.nbytes) // max(self.num_blocks, 1)

    def close(self) -> None:
        if self.array is not None:
            self.release()
            self.array = None


# ---- pools in shared memory (host pools everywhere, device pools on CPU machines) ---------

def create_shm_pool(reg: Registry, obj: str, shape: tuple, dtype: str, meta: dict) -> None:
    """Create, register and pre-fault (MAP_POPULATE) a pool segment, then unmap it.

    The pages stay allocated in /dev/shm after the unmap, so the first swap does not pay the
    first-touch cost (5-6 s per 2 GiB here); the registry owner unlinks the segment at exit."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    seg = reg.create_segment(obj, nbytes, kind="pool", dtype=dt.str, shape=tuple(shape), meta=meta,
                             prefault=True)
    seg.close()


def _open_shm_array(reg: Registry, obj: str) -> tuple[np.ndarray, Segment]:
    """Map a pool and build this process's page tables for it now.

    The creator's MAP_POPULATE allocated the pages, but every process that maps them still
    takes a minor fault per 4 KiB page on first touch (measured: 370 us for one 512 KiB block
    instead of 30 us), so without this the first swap of each block pays it."""
    info = reg.find(obj)
    if info.kind != "pool":
        raise IpcError(f"{info.name} is a {info.kind}, not a pool")
    seg = Segment.attach(info.name)
    try:
        seg.mm.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        pass  # a kernel older than 5.14: pages are mapped on first touch instead
    return np.ndarray(info.shape, dtype=np.dtype(info.dtype), buffer=seg.mm), seg


class ArrayBackend(ABC):
    """What a tier of KV blocks needs from an array library. Subclasses: numpy, CuPy."""

    name = ""

    @property
    @abstractmethod
    def xp(self) -> Any:
        """The array module of the device pool (numpy or cupy), for code that computes on it."""

    @abstractmethod
    def create_device_pool(self, reg: Registry, obj: str, shape: tuple, dtype: str, rank: int) -> Any:
        """Allocate and register rank `rank`'s device pool; returns what the creator must
        keep alive for as long as the node runs (None when the registry owns it all)."""

    @abstractmethod
    def open_device_pool(self, reg: Registry, obj: str) -> Pool:
        """Open a device pool that another process created (never the creator itself: CUDA
        refuses to open an IPC handle in the process that exported it)."""

    @abstractmethod
    def open_host_pool(self, reg: Registry, obj: str) -> Pool:
        """Open a host pool, made ready for fast copies to and from the device pool."""

    @abstractmethod
    def copy_runs(self, dst: Pool, src: Pool, runs: Sequence[Run]) -> None:
        """Copy every run (src block, dst block, count) and return once all bytes landed."""

    def issue_runs(self, dst: Pool, src: Pool, runs: Sequence[Run]) -> Any:
        """Start copying every run; returns a mark for `wait`/`is_done`, or None when the bytes
        already landed (a synchronous backend). A device issues the copies and returns at
        once, so the caller can answer an earlier task while they run; copies issued one
        after another land in that order."""
        self.copy_runs(dst, src, runs)
        return None

    def is_done(self, mark: Any) -> bool:
        """Whether every copy issued before `mark` has landed (never waits)."""
        return True

    def wait(self, mark: Any) -> None:
        """Return once every copy issued before `mark` has landed; `mark` is spent."""

    def host_buffer(self, shape: tuple, dtype: Any) -> np.ndarray:
        """A host array to stage copies to and from the device pool through `copy_runs` (as a
        Pool's array); pinned where the device needs it for full-speed, asynchronous copies."""
        return np.empty(shape, dtype)


class NumpyBackend(ArrayBackend):
    """CPU machines: both tiers are shared-memory segments and copies are memcpys."""

    name = "numpy"

    @property
    def xp(self) -> Any:
        return np

    def create_device_pool(self, reg: Registry, obj: str, shape: tuple, dtype: str, rank: int) -> None:
        create_shm_pool(reg, obj, shape, dtype, {"backend": self.name, "tier": "device", "rank": rank})
        return None

    def open_device_pool(self, reg: Registry, obj: str) -> Pool:
        return self._open(reg, obj, on_device=True)

    def open_host_pool(self, reg: Registry, obj: str) -> Pool:
        return self._open(reg, obj, on_device=False)

    def _open(self, reg: Registry, obj: str, on_device: bool) -> Pool:
        arr, seg = _open_shm_array(reg, obj)
        return Pool(seg.name, arr, self, on_device, seg.close)

    def copy_runs(self, dst: Pool, src: Pool, runs: Sequence[Run]) -> None:
        d, s = dst.array, src.array
        for sb, db, n in runs:
            np.copyto(d[db:db + n], s[sb:sb + n])


class CupyBackend(ArrayBackend):
    """GPU machines: the device pool is one cudaMalloc per rank, exported by a CUDA IPC handle
    kept in a registered segment; the host pool is the shared-memory segment, pinned with
    cudaHostRegister in each process that copies; copies are cudaMemcpyAsync on one stream of
    this process (non-blocking: nothing else on the GPU serialises with it), and a task waits
    on one event recorded after its copies (the answer must not precede the bytes, but the
    next task's copies may already be queued behind them). Events are reused, never made per
    task."""

    name = "cupy"

    @property
    def xp(self) -> Any:
        return self.cp

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as e:
            raise BackendUnavailable("device 'cuda' needs CuPy: pip install 'kvrt[gpu]' "
                                     f"(import failed: {e})") from None
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self._stream = 0
        self._events: list[int] = []  # recorded and waited for, free to record again

    def create_device_pool(self, reg: Registry, obj: str, shape: tuple, dtype: str, rank: int) -> Any:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        device = rank % self.rt.getDeviceCount()
        with self.cp.cuda.Device(device):
            free = int(self.rt.memGetInfo()[0])
            if nbytes > free:  # refused with both numbers, not a raw cudaErrorMemoryAllocation
                raise DeviceMemoryError(f"{obj}: {shape[0]} blocks need {nbytes} bytes on GPU {device}, "
                                        f"which has {free} bytes free; lower --num-gpu-blocks")
            mem = self.cp.cuda.Memory(nbytes)  # a plain cudaMalloc: IPC exports whole allocations
            self.rt.memset(mem.ptr, 0, nbytes)
            # cudaMemset of device memory returns before it lands, and a process that opens the
            # handle runs in its own context, unordered with this one: the zeros land first
            self.rt.deviceSynchronize()
            handle = bytes(self.rt.ipcGetMemHandle(mem.ptr))
        meta = {"backend": self.name, "tier": "device", "rank": rank, "device": device, "nbytes": nbytes}
        seg = reg.create_segment(obj, _HANDLE_LEN + len(handle), kind="pool", dtype=dt.str,
                                 shape=tuple(shape), meta=meta)
        seg.mm[:_HANDLE_LEN] = len(handle).to_bytes(_HANDLE_LEN, "little")
        seg.mm[_HANDLE_LEN:_HANDLE_LEN + len(handle)] = handle
        seg.close()
        return mem

    def open_device_pool(self, reg: Registry, obj: str) -> Pool:
        info = reg.find(obj)
        seg = Segment.attach(info.name)
        try:
            n = int.from_bytes(seg.mm[:_HANDLE_LEN], "little")
            handle = bytes(seg.mm[_HANDLE_LEN:_HANDLE_LEN + n])
        finally:
            seg.close()
        device = int(info.meta["device"])
        self.rt.setDevice(device)
        ptr = self.rt.ipcOpenMemHandle(handle)  # lazy peer access by default
        mem = self.cp.cuda.UnownedMemory(ptr, int(info.meta["nbytes"]), None, device)
        arr = self.cp.ndarray(info.shape, np.dtype(info.dtype), self.cp.cuda.MemoryPointer(mem, 0))
        return Pool(info.name, arr, self, True, lambda: self.rt.ipcCloseMemHandle(ptr))

    def open_host_pool(self, reg: Registry, obj: str) -> Pool:
        arr, seg = _open_shm_array(reg, obj)
        ptr = arr.ctypes.data
        self.rt.hostRegister(ptr, arr.nbytes, _HOST_REGISTER_PORTABLE)

        def release() -> None:
            self.rt.hostUnregister(ptr)
            seg.close()

        return Pool(seg.name, arr, self, False, release)

    def _ptr(self, pool: Pool) -> int:
        return int(pool.array.data.ptr) if pool.on_device else int(pool.array.ctypes.data)

    def _stream_ptr(self) -> int:
        if not self._stream:
            self._stream = self.rt.streamCreateWithFlags(_STREAM_NON_BLOCKING)
        return self._stream

    def copy_runs(self, dst: Pool, src: Pool, runs: Sequence[Run]) -> None:
        self.wait(self.issue_runs(dst, src, runs))

    def issue_runs(self, dst: Pool, src: Pool, runs: Sequence[Run]) -> int:
        bb = src.block_bytes
        d, s, stream = self._ptr(dst), self._ptr(src), self._stream_ptr()
        copy = self.rt.memcpyAsync
        for sb, db, n in runs:
            copy(d + db * bb, s + sb * bb, n * bb, _MEMCPY_DEFAULT, stream)
        event = self._events.pop() if self._events else self.rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        self.rt.eventRecord(event, stream)
        return event

    def is_done(self, mark: int) -> bool:
        return self.rt.eventQuery(mark) == _SUCCESS

    def wait(self, mark: int) -> None:
        self.rt.eventSynchronize(mark)
        self._events.append(mark)

    def host_buffer(self, shape: tuple, dtype: Any) -> np.ndarray:
        """Pinned (cudaHostAlloc) host memory: a copy from pageable memory goes through the
        driver's own bounce buffer and cannot overlap anything."""
        dt, count = np.dtype(dtype), int(np.prod(shape))
        mem = self.cp.cuda.alloc_pinned_memory(count * dt.itemsize)
        return np.frombuffer(mem, dt, count).reshape(shape)


def get_backend(device: str) -> ArrayBackend:
    """The backend for a node's `device` setting ("cpu" or "cuda")."""
    if device == "cpu":
        return NumpyBackend()
    if device == "cuda":
        return CupyBackend()
    raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")
