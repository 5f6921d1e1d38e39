"""How the attention kernels cut a batch into programs: the host-side arithmetic, without Triton
(the plain-torch op set and the CUDA graphs' buffers use it too)."""
from __future__ import annotations

import numpy as np

MAX_SPLITS = 16  # the most stretches decode attention cuts a context into (its combine kernel's tile)


def next_pow2(n: int, floor: int = 16) -> int:
    """The smallest power of two >= n and >= floor: a Triton block's length (tl.arange needs a
    power of two, and tl.dot operands at least 16 along each side)."""
    p = floor
    while p < n:
        p *= 2
    return p


def num_splits_for(batch: int, kv_heads: int, target_programs: int = 256) -> int:
    """How many stretches decode attention cuts each sequence's context into at this batch:
    enough programs to fill a GPU (`target_programs`, about two per streaming multiprocessor),
    at most MAX_SPLITS."""
    splits = 1
    while splits < MAX_SPLITS and batch * kv_heads * splits < target_programs:
        splits *= 2
    return splits


def scratch_shapes(batch: int, heads: int, head_dim: int, splits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of decode attention's two float32 scratch buffers for `batch` rows: the
    stretches' outputs and their (max, sum) pairs."""
    return (batch, heads, splits, head_dim), (batch, heads, splits, 2)


def block_m_for(longest: int) -> int:
    """Query rows per prefill tile for a step whose longest sequence computes `longest` tokens:
    16 when every sequence is a decode row or a short chunk (a bigger tile would be mostly
    padding), else 64."""
    return 16 if longest <= 16 else 64


def tiles(lens: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first row within it) of every prefill query tile of a batch whose sequences
    compute lens[i] tokens each (int32 host arrays, sequence-major)."""
    counts = -(-lens.astype(np.int64) // block_m)
    seq = np.repeat(np.arange(len(lens), dtype=np.int32), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    row = ((np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)) * block_m).astype(np.int32)
    return seq, row
