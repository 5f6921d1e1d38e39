"""Signals: small named numpy arrays in shared memory (ready flags, status words,
heartbeats, counters).

Single-writer words are plain numpy stores (x86 keeps stores ordered; readers only look).
Words that several processes update go through `add`, an atomic fetch-add, because a
numpy `+=` from two processes loses increments.
"""
from __future__ import annotations

import numpy as np

from kvrt.ipc._atomic import Region
from kvrt.ipc.errors import IpcError
from kvrt.ipc.registry import Registry
from kvrt.ipc.shm import Segment

_ATOMIC_DTYPES = {np.dtype(np.int32): 32, np.dtype(np.int64): 64}


class Signal:
    def __init__(self, name: str, seg: Segment, shape: tuple, dtype: np.dtype):
        self.name = name
        self._seg = seg
        self.array = np.ndarray(shape, dtype=dtype, buffer=seg.mm)
        self._region = Region(seg.mm)
        self._bits = _ATOMIC_DTYPES.get(np.dtype(dtype))

    @classmethod
    def create(cls, reg: Registry, obj: str, shape: tuple | int, dtype=np.int64,
               fill: int = 0) -> "Signal":
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dt = np.dtype(dtype)
        size = max(int(np.prod(shape)) * dt.itemsize, 8)
        seg = reg.create_segment(obj, size, kind="signal", dtype=dt.str, shape=shape)
        sig = cls(seg.name, seg, shape, dt)
        sig.array[...] = fill
        return sig

    @classmethod
    def attach(cls, reg: Registry, obj: str) -> "Signal":
        info = reg.find(obj)
        if info.kind != "signal":
            raise IpcError(f"{info.name} is a {info.kind}, not a signal")
        return cls(info.name, Segment.attach(info.name), info.shape, np.dtype(info.dtype))

    def _offset(self, index: int | tuple) -> int:
        flat = int(np.ravel_multi_index(index, self.array.shape)) if isinstance(index, tuple) else int(index)
        if not 0 <= flat < self.array.size:
            raise IndexError(f"{self.name}: index {index} out of range {self.array.shape}")
        return flat * self.array.itemsize

    def add(self, index: int | tuple, delta: int = 1) -> int:
        """Atomic fetch-add; returns the value before the add."""
        if self._bits == 32:
            return self._region.fetch_add32(self._offset(index), delta)
        if self._bits == 64:
            return self._region.fetch_add64(self._offset(index), delta)
        raise IpcError(f"{self.name}: atomic add needs int32 or int64, not {self.array.dtype}")

    def close(self) -> None:
        self.array = None
        self._region.release()
        self._seg.close()
