"""An all-reduce (sum) of float32 arrays across the tensor-parallel ranks of a node, through one
shared-memory segment: no socket, no lock.

Layout: one generation counter per rank (each on its own cache line), then two buffers of
`tp` slots of `capacity` floats. A call of generation g writes the caller's array into its slot
of buffer g % 2, publishes g with a store-release, waits (bounded) until every rank published
g, and sums the slots in rank order, so every rank gets bit-identical sums (identical greedy
tokens on every rank). Two buffers suffice: a rank can only write generation g + 2 into the
buffer of g after every rank published g + 1, which each does only after it finished reading
g. Every rank must call it the same number of times with arrays of the same shape: the model's
forward pass does, as every rank runs the same step batch.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ._atomic import Region
from .errors import IpcError, WaitTimeout
from .registry import Registry
from .shm import Segment

_LINE = 64             # bytes per rank's counter: one cache line each, so ranks do not share one
_SPIN_S = 0.001        # yield the CPU between polls for this long, then sleep in short naps
_NAP_S = 0.0001
KIND = "segment"


def _sizes(tp: int, capacity: int) -> tuple[int, int]:
    header = tp * _LINE
    return header, header + 2 * tp * capacity * 4


def segment_bytes(tp: int, capacity: int) -> int:
    """Bytes of the segment of `tp` ranks contributing up to `capacity` floats each."""
    return _sizes(tp, capacity)[1]


class AllReduce:
    """Rank `rank`'s end of a node's all-reduce; `sum(x)` returns the sum over ranks of x."""

    def __init__(self, seg: Segment, tp: int, capacity: int, rank: int, timeout: float) -> None:
        if not 0 <= rank < tp:
            raise IpcError(f"all-reduce {seg.name}: rank {rank} outside [0, {tp})")
        header, size = _sizes(tp, capacity)
        if len(seg.mm) < size:
            raise IpcError(f"all-reduce {seg.name}: segment of {len(seg.mm)} bytes, {size} needed")
        self.name, self.tp, self.capacity, self.rank, self.timeout = seg.name, tp, capacity, rank, timeout
        self._seg = seg
        self._region = Region(seg.mm)
        self._slots = np.ndarray((2, tp, capacity), dtype=np.float32, buffer=seg.mm, offset=header)
        self._gen = self._region.load64(rank * _LINE)

    @classmethod
    def create(cls, reg: Registry, obj: str, tp: int, capacity: int) -> None:
        """Register and create the segment (zeroed: every generation starts at 0)."""
        if tp <= 0 or capacity <= 0:
            raise ValueError(f"all-reduce needs tp > 0 and capacity > 0, got {tp} and {capacity}")
        seg = reg.create_segment(obj, _sizes(tp, capacity)[1], kind=KIND, meta={"allreduce": True, "tp": tp,
                                                                                  "capacity": capacity})
        seg.close()

    @classmethod
    def attach(cls, reg: Registry, obj: str, rank: int, timeout: float) -> "AllReduce":
        info = reg.find(obj)
        if not info.meta.get("allreduce"):
            raise IpcError(f"{info.name} is not an all-reduce segment")
        return cls(Segment.attach(info.name), int(info.meta["tp"]), int(info.meta["capacity"]), rank, timeout)

    def sum(self, x: Any) -> np.ndarray:
        """The elementwise sum over all ranks of their `x` (a float32 host array of the same
        shape on every rank). WaitTimeout names the ranks that did not arrive in time."""
        x = np.asarray(x, dtype=np.float32)
        n = x.size
        if n > self.capacity:
            raise ValueError(f"all-reduce {self.name}: {n} floats exceed its capacity {self.capacity}")
        gen = self._gen + 1
        buf = self._slots[gen % 2]
        buf[self.rank, :n] = x.ravel()
        self._region.store64(self.rank * _LINE, gen)
        self._wait(gen)
        out = buf[0, :n].copy()
        for r in range(1, self.tp):
            out += buf[r, :n]
        self._gen = gen
        return out.reshape(x.shape)

    def _wait(self, gen: int) -> None:
        t0 = time.monotonic()
        load = self._region.load64
        pending = [r for r in range(self.tp) if r != self.rank]
        while pending:
            pending = [r for r in pending if load(r * _LINE) < gen]
            if not pending:
                return
            waited = time.monotonic() - t0
            if waited > self.timeout:
                raise WaitTimeout(f"all-reduce {self.name}: rank {self.rank} waited {waited:.1f} s for "
                                  f"rank(s) {pending} to reach generation {gen}")
            time.sleep(0 if waited < _SPIN_S else _NAP_S)

    def close(self) -> None:
        self._slots = None
        self._region.release()
        self._seg.close()
