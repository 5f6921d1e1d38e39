"""How a cache-transfer rank moves a storage task's blocks between its device pool and the
storage backend, in batches.

Why two ways: a pool in host memory (a CPU node's device pool is shared memory) is registered
with the backend once and read into / written from in place, a whole task in one batch, with no
copy of our own. A pool the backend cannot address (GPU memory) goes through a host staging area
of `STAGE_BLOCKS` blocks (pinned, registered once), a batch of at most that many blocks at a
time: the batch's device<->host copies issued together with one wait (`copy_runs`, as a swap's),
and batched store I/O.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kvrt.workers.backend import Pool
from kvrt.workers.storage.base import Storage

STAGE_BLOCKS = 64


class InPlaceBlocks:
    """Blocks of a host-memory pool, handed to the backend as views of the pool itself."""

    def __init__(self, pool: Pool, storage: Storage, beat: Callable[[], None]):
        self.pool, self.storage, self.beat = pool, storage, beat
        storage.register(pool.array)

    def read(self, blocks: list[int], keys: list[bytes], deadline: float) -> int:
        """Leading blocks read (the first miss ends it); nothing is written past `deadline`."""
        arr = self.pool.array
        done = self.storage.get_many(keys, [arr[b] for b in blocks], deadline)
        self.beat()
        return done

    def write(self, blocks: list[int], keys: list[bytes]) -> int:
        """Store the blocks whose keys the backend lacks; returns the bytes written."""
        arr = self.pool.array
        written = self.storage.put_many(keys, [arr[b] for b in blocks])
        self.beat()
        return written


class StagedBlocks:
    """Blocks of a pool the backend cannot address, through a registered host staging area."""

    def __init__(self, pool: Pool, storage: Storage, beat: Callable[[], None], stage_blocks: int = STAGE_BLOCKS):
        self.pool, self.storage, self.beat = pool, storage, beat
        self.stage = pool.backend.host_buffer((stage_blocks, *pool.array.shape[1:]), pool.array.dtype)
        self.staged = Pool(f"{pool.name} staging", self.stage, pool.backend, False, lambda: None)
        storage.register(self.stage)

    def read(self, blocks: list[int], keys: list[bytes], deadline: float) -> int:
        """Leading blocks read (the first miss ends it); nothing is written past `deadline`."""
        backend, n = self.pool.backend, len(self.stage)
        done = 0
        for i in range(0, len(blocks), n):
            if deadline and time.monotonic() >= deadline:
                break
            chunk = blocks[i:i + n]
            got = self.storage.get_many(keys[i:i + n], list(self.stage[:len(chunk)]), deadline)
            if got:
                backend.copy_runs(self.pool, self.staged, [(j, b, 1) for j, b in enumerate(chunk[:got])])
            done += got
            self.beat()
            if got < len(chunk):
                break
        return done

    def write(self, blocks: list[int], keys: list[bytes]) -> int:
        """Store the blocks whose keys the backend lacks; returns the bytes written."""
        backend, n = self.pool.backend, len(self.stage)
        written = 0
        for i in range(0, len(blocks), n):
            chunk = blocks[i:i + n]
            backend.copy_runs(self.staged, self.pool, [(b, j, 1) for j, b in enumerate(chunk)])
            written += self.storage.put_many(keys[i:i + n], list(self.stage[:len(chunk)]))
            self.beat()
        return written


def block_io(pool: Pool, storage: Storage, beat: Callable[[], None]) -> InPlaceBlocks | StagedBlocks:
    """The way to move `pool`'s blocks to and from `storage` (see the module docstring)."""
    if isinstance(pool.array, np.ndarray) and pool.array.flags.c_contiguous:
        return InPlaceBlocks(pool, storage, beat)
    return StagedBlocks(pool, storage, beat)
