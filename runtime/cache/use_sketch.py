"""How many recent requests used a block key, whether or not the block was cached: a small
count sketch, so that a block evicted and computed again is not mistaken for a new one.

Why: on a trace whose reuse distance is longer than the cache (the conversation trace at 20,000
blocks: a conversation's next turn comes ~400 requests later), a block's reuse count dies with
its node, and a policy that ranks by reuse would see every block as new. The sketch remembers
use counts past eviction, for a fixed memory: two rows of 8-bit saturating counters indexed by
two halves of the key's hash (a key's count is the smaller of its two counters, so a collision
inflates it only when both rows collide). Counters are halved once as many uses were added as a
quarter of a row holds, so old popularity fades and the rows never fill up. Costs one C call
per request (runtime/cache/_cache_core.c: a few vectorised operations per request in Python cost as
much as the cache's own work; tests/runtime/cache/cache_reference.py holds that numpy code, the reference the
C is tested against). Keys are block keys (16-byte digests, runtime/cache/keys.py): their first 8
bytes are already uniform, so a key's two slots are those bytes, masked, and the same shifted
right by 32, masked; any other key is refused.

With `timed`, it also remembers when a key was last used (the request count, in two rows of
32-bit stamps under the same slots; a key's stamp is the older of its two, so a collision can
only make it look recent): `add` then says how many requests ago each key was used before,
which tells a policy whether a block's reuse comes back within what the cache can hold. A
slot's stamp and count are kept side by side (5 bytes a slot, a row of records viewed as a row of
stamps and a row of counts), so that counting and stamping a key costs one cache miss per row,
not two: the rows are far larger than the CPU caches, and these misses are most of the sketch's
time.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvrt.runtime.cache.core import sketch_add as _add_c, sketch_count as _count_c, sketch_raise as _raise_c

MIN_BITS, MAX_BITS = 16, 24
SLOTS_PER_NODE = 64


class UseSketch:
    """Approximate per-key use counts (0..255) over the recent past of a cache of `nodes` nodes."""

    __slots__ = ("_rows", "_r0", "_r1", "_int_mask", "_added", "_halve_at", "_stamps", "_s0", "_s1", "_now")

    def __init__(self, nodes: int, timed: bool = False):
        bits = min(MAX_BITS, max(MIN_BITS, (SLOTS_PER_NODE * nodes - 1).bit_length()))
        self._int_mask = (1 << bits) - 1
        if timed:  # per slot a record of its stamp (uint32, unaligned) and its count (uint8)
            cells = np.zeros((2, 1 << bits, 5), dtype=np.uint8)
            self._rows = cells[:, :, 4]
            # request count of each slot's latest use (0: none yet), only when timed
            self._stamps = cells[:, :, :4].view(np.uint32)[:, :, 0]
        else:
            self._rows = np.zeros((2, 1 << bits), dtype=np.uint8)
            self._stamps = None
        self._r0, self._r1 = self._rows  # views, for the C functions
        self._s0, self._s1 = self._stamps if timed else (None, None)
        self._added = 0
        self._halve_at = (1 << bits) // 4
        self._now = 0

    def add(self, keys: Sequence[bytes]) -> np.ndarray | None:
        """Count one use of each of `keys` (distinct keys: one request's). Timed: returns how
        many requests ago each key was used before (int64; -1: never, as far as the stamps
        know), else None. ValueError, nothing counted, if a key is not 16 bytes."""
        if not len(keys):
            return np.empty(0, dtype=np.int64) if self._stamps is not None else None
        if self._stamps is None:
            ages = None
            if not _add_c(self._r0, self._r1, keys, self._int_mask):
                raise _not_block_keys()
        else:  # stamped and counted in one call
            now = self._now + 1
            ages = np.empty(len(keys), dtype=np.int64)
            if not _add_c(self._r0, self._r1, keys, self._int_mask, self._s0, self._s1, now, ages):
                raise _not_block_keys()
            self._now = now
        self._added += len(keys)
        if self._added >= self._halve_at:
            self._rows >>= 1
            self._added = 0
        return ages

    def count(self, keys: Sequence[bytes]) -> np.ndarray:
        """The use counts of `keys` (int32; may overestimate, never underestimates a key added
        since the last halving)."""
        out = np.empty(len(keys), dtype=np.int32)
        if not _count_c(self._r0, self._r1, keys, self._int_mask, out):
            raise _not_block_keys()
        return out

    def raise_hits(self, keys: Sequence[bytes], hits: np.ndarray, nodes: np.ndarray, cap: int | None) -> None:
        """Raise `hits[nodes]` (an int32 row) to the counts of their `keys` minus one, each
        capped by `cap` (None: no cap) and by the keys before it, at least 0, in one C call."""
        if not _raise_c(self._r0, self._r1, keys, self._int_mask, hits, nodes, cap):
            raise _not_block_keys()


def _not_block_keys() -> ValueError:
    return ValueError("the use sketch counts block keys: every key must be 16 bytes (runtime/cache/keys.py)")
