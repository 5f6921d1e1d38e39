"""CUDA IPC's stand-in on a CPU machine, for testing the all-reduce's peer-memory mode
(ipc/allreduce.py) between real processes: each rank's slots are a POSIX shared-memory segment
of its own (as a GPU rank's are a cudaMalloc of its own), exported by name (as by a CUDA IPC
handle) and opened by name in the other ranks' processes."""
from __future__ import annotations

from typing import Any

import numpy as np

from kvrt.ipc.allreduce import PeerMemory
from kvrt.ipc.shm import Segment, object_name


class ShmPeerMemory(PeerMemory):
    """Rank `rank` of node `node`'s slots in segment kvrt.<node>.peer<rank> (so the node
    fixture's leak check covers it); `fences` counts the fences asked for."""

    def __init__(self, node: str, rank: int) -> None:
        self.name = object_name(node, f"peer{rank}")
        self.fences = 0
        self._own: Segment | None = None
        self._opened: list[Segment] = []

    @property
    def xp(self) -> Any:
        return np

    def allocate(self, nbytes: int) -> tuple[Any, bytes]:
        self._own = Segment.create(self.name, nbytes)
        return np.ndarray((nbytes // 4,), np.float32, buffer=self._own.mm), self.name.encode()

    def open(self, handle: bytes, nbytes: int) -> Any:
        seg = Segment.attach(handle.decode())
        assert len(seg.mm) >= nbytes, f"{seg.name}: {len(seg.mm)} bytes, {nbytes} expected"
        self._opened.append(seg)
        return np.ndarray((nbytes // 4,), np.float32, buffer=seg.mm)

    def fence(self) -> None:
        self.fences += 1  # a numpy store is complete when it returns

    def close(self) -> None:
        for seg in self._opened:
            seg.close()
        if self._own is not None:
            self._own.close()
            self._own.unlink()
