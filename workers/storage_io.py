"""How a cache-transfer rank moves a storage task's blocks between its device pool and the
storage backend, in batches.

Why two ways: a pool in host memory (a CPU node's device pool is shared memory) is registered
with the backend once and read into / written from in place, a whole task in one batch, with no
copy of our own. A pool the backend cannot address (GPU memory) goes through a host staging area
of `STAGE_BLOCKS` blocks, registered once, a batch of at most that many blocks at a time: one
device<->host copy per block (the backend's `read_block`/`commit`) and batched store I/O still.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .backend import Pool
from .storage import Storage

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
        self.stage = np.empty((stage_blocks, pool.block_bytes), np.uint8)
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
            for b, row in zip(chunk[:got], self.stage):
                backend.commit(self.pool, b, row)
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
            for b, row in zip(chunk, self.stage):
                row[:] = backend.read_block(self.pool, b).reshape(-1).view(np.uint8)
            written += self.storage.put_many(keys[i:i + n], list(self.stage[:len(chunk)]))
            self.beat()
        return written


def block_io(pool: Pool, storage: Storage, beat: Callable[[], None]) -> InPlaceBlocks | StagedBlocks:
    """The way to move `pool`'s blocks to and from `storage` (see the module docstring)."""
    if isinstance(pool.array, np.ndarray) and pool.array.flags.c_contiguous:
        return InPlaceBlocks(pool, storage, beat)
    return StagedBlocks(pool, storage, beat)
