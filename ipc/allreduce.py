"""An all-reduce (sum) of float32 arrays across the tensor-parallel ranks of a node, through
shared memory: no socket, no lock.

Layout: one generation counter per rank (each on its own cache line), then the ranks' slots:
two buffers of `capacity` floats per rank. A call of generation g writes the caller's array
into its slot of buffer g % 2, makes that write complete (`fence`), publishes g with a
store-release, waits (bounded) until every rank published g, and sums the slots in rank
order, so every rank gets bit-identical sums (identical greedy tokens on every rank). Two
buffers suffice: a rank can only write generation g + 2 into the buffer of g after every rank
published g + 1, which each does only after its reads of g completed (the fence before
publishing g + 1 covers them). Every rank must call it the same number of times with arrays of
the same shape: the model's forward pass does, as every rank runs the same step batch.

Where the slots live is the one thing that differs between a CPU and a GPU node:
- host slots: in the segment itself, after the counters (numpy ranks);
- peer memory (`PeerMemory`): each rank allocates its own slots where it computes (a GPU
  rank: device memory) and posts a handle to them in the segment's handle table (a CUDA IPC
  handle); the others open it on their first call. The counters, the handle exchange and the
  algorithm stay here, where they run, and are tested, over any array module; what a device
  needs (allocate, export, open, fence) is a small `PeerMemory` of its own
  (workers/cuda_allreduce.py for CuPy), which works for several ranks on one GPU too.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np

from kvrt.ipc._atomic import Region
from kvrt.ipc.errors import IpcError, WaitTimeout
from kvrt.ipc.registry import Registry
from kvrt.ipc.shm import Segment

_LINE = 64             # bytes per rank's counter: one cache line each, so ranks do not share one
_ENTRY = 256           # bytes per rank's handle table entry: an int64 length, then the handle
_SPIN_S = 0.001        # yield the CPU between polls for this long, then sleep in short naps
_NAP_S = 0.0001
KIND = "segment"

log = logging.getLogger("kvrt.ipc.allreduce")


class PeerMemory(ABC):
    """Where one rank's slots live when they are not in the segment, and how the other ranks
    reach them: memory this rank allocates and exports by an opaque handle, which another
    process opens."""

    @property
    @abstractmethod
    def xp(self) -> Any:
        """The array module of the slots (and of the arrays `AllReduce.sum` takes and returns)."""

    @abstractmethod
    def allocate(self, nbytes: int) -> tuple[Any, bytes]:
        """This rank's slots: a flat float32 array of `nbytes` bytes, and the handle to post."""

    @abstractmethod
    def open(self, handle: bytes, nbytes: int) -> Any:
        """Another rank's slots from the handle it posted: a flat float32 array of `nbytes`."""

    @abstractmethod
    def fence(self) -> None:
        """Return once every write and read this rank issued on any slots has completed (a
        GPU's kernels run asynchronously: the flag must not be published before the bytes)."""

    def close_peers(self) -> None:
        """Close the peers' slots this rank opened, before it tells them it is done with them
        (their owners free them only after that); `close` closes any still open."""

    @abstractmethod
    def close(self) -> None:
        """Close the peers' slots this rank opened and free its own."""


def _sizes(tp: int, capacity: int, peer_memory: bool = False) -> tuple[int, int]:
    """(offset of the slots or the handle table, segment bytes)."""
    header = tp * _LINE
    return header, header + (tp * _ENTRY if peer_memory else 2 * tp * capacity * 4)


def segment_bytes(tp: int, capacity: int, peer_memory: bool = False) -> int:
    """Bytes of the segment of `tp` ranks contributing up to `capacity` floats each (with
    `peer_memory` the slots are the ranks' own, and the segment holds their handles)."""
    return _sizes(tp, capacity, peer_memory)[1]


class AllReduce:
    """Rank `rank`'s end of a node's all-reduce; `sum(x)` returns the sum over ranks of x."""

    def __init__(self, seg: Segment, tp: int, capacity: int, rank: int, timeout: float,
                 memory: PeerMemory | None = None) -> None:
        if not 0 <= rank < tp:
            raise IpcError(f"all-reduce {seg.name}: rank {rank} outside [0, {tp})")
        header, size = _sizes(tp, capacity, memory is not None)
        if len(seg.mm) < size:
            raise IpcError(f"all-reduce {seg.name}: segment of {len(seg.mm)} bytes, {size} needed")
        self.name, self.tp, self.capacity, self.rank, self.timeout = seg.name, tp, capacity, rank, timeout
        self._seg = seg
        self._region = Region(seg.mm)
        self._memory = memory
        self._table = header
        self._gen = self._region.load64(rank * _LINE)
        self._slots: list[Any] = [None] * tp  # rank -> its [2, capacity] slots (peers': opened on first use)
        if memory is None:
            host = np.ndarray((2, tp, capacity), dtype=np.float32, buffer=seg.mm, offset=header)
            self._slots = [host[:, r] for r in range(tp)]
            self.xp: Any = np
        else:
            self.xp = memory.xp
            own, handle = memory.allocate(2 * capacity * 4)
            self._slots[rank] = own.reshape(2, capacity)
            self._post(handle)

    @classmethod
    def create(cls, reg: Registry, obj: str, tp: int, capacity: int, peer_memory: bool = False) -> None:
        """Register and create the segment (zeroed: every generation starts at 0, and no rank
        has posted a handle). With `peer_memory` the ranks bring their own slots."""
        if tp <= 0 or capacity <= 0:
            raise ValueError(f"all-reduce needs tp > 0 and capacity > 0, got {tp} and {capacity}")
        seg = reg.create_segment(obj, _sizes(tp, capacity, peer_memory)[1], kind=KIND,
                                 meta={"allreduce": True, "tp": tp, "capacity": capacity,
                                       "peer_memory": peer_memory})
        seg.close()

    @classmethod
    def attach(cls, reg: Registry, obj: str, rank: int, timeout: float,
               memory: PeerMemory | None = None) -> "AllReduce":
        """Rank `rank`'s end; `memory` must be given exactly when the segment was created for
        peer memory (a GPU node's), or the ranks would not meet in the same slots."""
        info = reg.find(obj)
        if not info.meta.get("allreduce"):
            raise IpcError(f"{info.name} is not an all-reduce segment")
        if bool(info.meta.get("peer_memory")) != (memory is not None):
            want = "its ranks' own memory" if info.meta.get("peer_memory") else "host slots"
            raise IpcError(f"all-reduce {info.name} was created for {want}; rank {rank} attached "
                           f"{'with' if memory is not None else 'without'} peer memory")
        return cls(Segment.attach(info.name), int(info.meta["tp"]), int(info.meta["capacity"]), rank, timeout,
                   memory)

    # ---- the handle exchange (peer memory) --------------------------------------------------

    def _post(self, handle: bytes) -> None:
        """Publish this rank's handle: the bytes first, then their length (store-release), so
        a reader that sees a length reads the whole handle."""
        if not 0 < len(handle) <= _ENTRY - 8:
            raise IpcError(f"all-reduce {self.name}: a handle of {len(handle)} bytes does not fit its "
                           f"{_ENTRY - 8}-byte entry")
        off = self._table + self.rank * _ENTRY
        self._seg.mm[off + 8:off + 8 + len(handle)] = handle
        self._region.store64(off, len(handle))

    def _open_peers(self) -> None:
        """Open every other rank's slots, waiting (bounded) for the ranks that have not posted
        a handle yet; WaitTimeout names them."""
        nbytes = 2 * self.capacity * 4

        def missing() -> list[int]:
            for r in range(self.tp):
                if self._slots[r] is None:
                    off = self._table + r * _ENTRY
                    n = self._region.load64(off)
                    if n:
                        if not 0 < n <= _ENTRY - 8:
                            raise IpcError(f"all-reduce {self.name}: rank {r} posted a handle of {n} bytes")
                        handle = bytes(self._seg.mm[off + 8:off + 8 + n])
                        self._slots[r] = self._memory.open(handle, nbytes).reshape(2, self.capacity)
            return [r for r in range(self.tp) if self._slots[r] is None]

        self._until(missing, "to post their buffers' handles")

    # ---- the all-reduce ----------------------------------------------------------------------

    def sum(self, x: Any) -> Any:
        """The elementwise sum over all ranks of their `x` (a float32 array of this
        all-reduce's array module, of the same shape on every rank), as an array of that module.
        WaitTimeout names the ranks that did not arrive in time."""
        x = self.xp.asarray(x, dtype=np.float32)
        n = x.size
        if n > self.capacity:
            raise ValueError(f"all-reduce {self.name}: {n} floats exceed its capacity {self.capacity}")
        if self._memory is not None and any(s is None for s in self._slots):
            self._open_peers()
        gen = self._gen + 1
        b = gen % 2
        self._slots[self.rank][b, :n] = x.ravel()
        if self._memory is not None:
            self._memory.fence()
        self._region.store64(self.rank * _LINE, gen)
        self._wait(gen)
        out = self._slots[0][b, :n].copy()
        for r in range(1, self.tp):
            out += self._slots[r][b, :n]
        self._gen = gen
        return out.reshape(x.shape)

    def _wait(self, gen: int) -> None:
        load = self._region.load64
        pending = [r for r in range(self.tp) if r != self.rank]

        def behind() -> list[int]:
            pending[:] = [r for r in pending if load(r * _LINE) < gen]
            return pending

        self._until(behind, f"to reach generation {gen}")

    def _until(self, missing: Callable[[], list[int]], what: str) -> None:
        """Spin, then nap, until `missing()` (the ranks still awaited) is empty; WaitTimeout after
        `timeout` names them and what they were awaited for."""
        t0 = time.monotonic()
        while ranks := missing():
            waited = time.monotonic() - t0
            if waited > self.timeout:
                raise WaitTimeout(f"all-reduce {self.name}: rank {self.rank} waited {waited:.1f} s for "
                                  f"rank(s) {ranks} {what}")
            time.sleep(0 if waited < _SPIN_S else _NAP_S)

    def close(self) -> None:
        """Detach. With peer memory, this rank's slots are freed only once every rank has closed
        its mapping of them (or `timeout` passed: a rank that died maps nothing): a peer may still
        be about to read the last generation's slot when this rank returns from it, and CUDA
        leaves undefined an exporter freeing memory that an importer has not closed yet."""
        if self._memory is not None:
            self._slots = []  # the arrays over the peers' mappings go before the mappings
            self._memory.fence()  # this rank's reads of the peers' slots have completed
            self._memory.close_peers()
            self._gen += 1
            self._region.store64(self.rank * _LINE, self._gen)
            try:
                self._wait(self._gen)
            except WaitTimeout as e:
                log.warning("%s; freeing this rank's slots anyway", e)
        self._slots = []
        if self._memory is not None:
            self._memory.close()
        self._region.release()
        self._seg.close()
