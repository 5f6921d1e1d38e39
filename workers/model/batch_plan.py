"""A step batch checked and laid out for the torch backend in a fixed number of array operations.

Why not the reference model's `Model._plan`: it checks each sequence with a dozen NumPy calls,
about 30 us a sequence, which is nothing next to a CPU's step but 8 ms at a batch of 256, several
times a GPU's whole decode step once that step is a CUDA graph. Here every check runs once over
the whole batch (the Python loop left only reads each sequence's three fields), with the same
checks and the same refusals: token ids in the vocabulary, positions within max_model_len, block
tables that are 1-D integer arrays long enough for their positions, holding block ids of the
pool and no id twice, and no two sequences writing one pool slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class BatchPlan:
    """Where each of a batch's tokens goes: sequence i computes lens[i] tokens from position
    starts[i], over tables[i] (its first -(-(starts + lens) // block_size) blocks, zero-padded to
    `width`); `tokens`, `positions` and `slots` (block * block_size + offset) are per token,
    sequence-major."""

    tokens: np.ndarray     # int32
    positions: np.ndarray  # int32
    slots: np.ndarray      # int32
    lens: np.ndarray       # int32
    starts: np.ndarray     # int32
    tables: np.ndarray     # int32 [sequences, width]
    width: int


def plan_batch(seqs: Sequence, num_blocks: int, block_size: int, vocab: int, max_len: int) -> BatchPlan:
    """The batch `seqs` (SeqInput: tokens, start, block_table) checked and laid out; ValueError
    naming the first sequence that breaks a rule (module docstring)."""
    n = len(seqs)
    toks = [np.asarray(s.tokens) for s in seqs]
    tabs = [np.asarray(s.block_table) for s in seqs]
    for i, (t, b) in enumerate(zip(toks, tabs)):
        if t.ndim != 1 or t.size == 0 or t.dtype.kind not in "iu":
            raise ValueError(f"seq {i}: tokens must be a non-empty 1-D integer array, got {t.dtype} shape {t.shape}")
        if b.ndim != 1 or b.dtype.kind not in "iu":
            raise ValueError(f"seq {i}: block_table must be a 1-D integer array, got {b.dtype} shape {b.shape}")
    lens = np.fromiter((t.size for t in toks), np.int64, n)
    starts = np.fromiter((int(s.start) for s in seqs), np.int64, n)
    tokens = np.concatenate(toks).astype(np.int64)
    if tokens.min() < 0 or tokens.max() >= vocab:
        i = int(np.repeat(np.arange(n), lens)[np.flatnonzero((tokens < 0) | (tokens >= vocab))[0]])
        raise ValueError(f"seq {i}: token id out of range [0, {vocab})")
    ends = starts + lens
    if (bad := np.flatnonzero((starts < 0) | (ends > max_len))).size:
        i = int(bad[0])
        raise ValueError(f"seq {i}: positions {starts[i]}..{ends[i] - 1} outside 0..{max_len - 1} (max_model_len)")
    need = -(-ends // block_size)
    have = np.fromiter((b.size for b in tabs), np.int64, n)
    if (bad := np.flatnonzero(have < need)).size:
        i = int(bad[0])
        raise ValueError(f"seq {i}: block_table has {have[i]} blocks, positions 0..{ends[i] - 1} need {need[i]} "
                         f"blocks of {block_size}")
    width = int(need.max())
    used = np.arange(width)[None, :] < need[:, None]
    table = np.zeros((n, width), np.int64)
    table[used] = np.concatenate([b[:k] for b, k in zip(tabs, need.tolist())])
    ids = table[used]
    if ids.min() < 0 or ids.max() >= num_blocks:
        i = int(np.flatnonzero(((table < 0) | (table >= num_blocks)) & used)[0] // width)
        raise ValueError(f"seq {i}: block_table holds block ids outside [0, {num_blocks})")
    ordered = np.sort(np.where(used, table, -1 - np.arange(width)[None, :]), axis=1)  # padding: distinct, negative
    if (bad := np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))).size:
        raise ValueError(f"seq {int(bad[0])}: block_table repeats a block id")
    first = np.repeat(np.cumsum(lens) - lens, lens)
    positions = np.repeat(starts, lens) + (np.arange(int(lens.sum())) - first)
    slots = table[np.repeat(np.arange(n), lens), positions // block_size] * block_size + positions % block_size
    if np.unique(slots).size != slots.size:
        raise ValueError("two seqs of the batch would write the same pool slot "
                         "(block tables overlap beyond a shared prefix)")
    return BatchPlan(tokens.astype(np.int32), positions.astype(np.int32), slots.astype(np.int32),
                     lens.astype(np.int32), starts.astype(np.int32), table.astype(np.int32), width)
