"""A storage task's blocks through both ways a cache-transfer rank moves them: in place (a
host-memory pool) and through the staging area (a pool the backend cannot address, like a
GPU's; here a fake backend that counts its copies: a staging area's batch is one `copy_runs`,
one wait, as on a GPU)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvrt.workers.backend import NumpyBackend, Pool
from kvrt.workers.storage.base import FileStorage
from kvrt.workers.storage.io import InPlaceBlocks, StagedBlocks, block_io

SHAPE = (2, 2, 4, 8)


class CopyingBackend(NumpyBackend):
    """numpy copies, counted per `copy_runs` call (blocks per call)."""

    name = "copying"

    def __init__(self) -> None:
        self.copies: list[int] = []

    def copy_runs(self, dst: Pool, src: Pool, runs) -> None:
        self.copies.append(len(runs))
        super().copy_runs(dst, src, runs)


def pool(backend, n: int = 200, seed: int = 0) -> Pool:
    arr = np.random.default_rng(seed).random((n, *SHAPE), dtype=np.float32)
    return Pool("test", arr, backend, True, lambda: None)


@pytest.mark.parametrize("kind", [InPlaceBlocks, StagedBlocks])
def test_blocks_round_trip_in_batches_and_stop_at_the_first_miss(tmp_path, kind):
    src, dst = pool(CopyingBackend(), seed=1), pool(CopyingBackend(), seed=2)
    storage = FileStorage(str(tmp_path), 0)
    beats = []
    io_src = kind(src, storage, lambda: beats.append(1))
    io_dst = kind(dst, storage, lambda: None)
    blocks = list(range(3, 153))  # more than one staging area's worth
    keys = [i.to_bytes(16, "little") for i in blocks]
    assert io_src.write(blocks, keys) == len(blocks) * src.block_bytes and beats
    dest = list(range(10, 160))
    assert io_dst.read(dest, keys, 0.0) == len(blocks)
    staged = [64, 64, 22] if kind is StagedBlocks else []  # one copy per staging batch, none in place
    assert (src.backend.copies, dst.backend.copies) == (staged, staged)
    assert np.array_equal(dst.array[10:160], src.array[3:153])
    assert io_src.write(blocks, keys) == 0, "blocks the storage holds are not written again"
    missing = keys[:100] + [b"\xff" * 16] + keys[101:]
    assert io_dst.read(dest, missing, 0.0) == 100
    before = dst.array.copy()
    assert io_dst.read(dest, keys, time.monotonic() - 1) == 0
    assert np.array_equal(dst.array, before), "nothing is written past the deadline"


def test_block_io_picks_in_place_for_host_memory_only(tmp_path):
    storage = FileStorage(str(tmp_path), 0)
    assert isinstance(block_io(pool(NumpyBackend()), storage, lambda: None), InPlaceBlocks)

    class DeviceArray:  # not a numpy array: memory the backend cannot address
        shape, nbytes, dtype = (4, 64), 4 * 256, np.dtype(np.float32)

    device = Pool("dev", DeviceArray(), CopyingBackend(), True, lambda: None)
    assert isinstance(block_io(device, storage, lambda: None), StagedBlocks)
