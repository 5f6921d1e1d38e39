"""How many recent requests used a block key, whether or not the block was cached: a small
count sketch, so that a block evicted and computed again is not mistaken for a new one.

Why: on a trace whose reuse distance is longer than the cache (the conversation trace at 20,000
blocks: a conversation's next turn comes ~400 requests later), a block's reuse count dies with
its node, and a policy that ranks by reuse would see every block as new. The sketch remembers
use counts past eviction, for a fixed memory: two rows of 8-bit saturating counters indexed by
two halves of the key's hash (a key's count is the smaller of its two counters, so a collision
inflates it only when both rows collide). Counters are halved once as many uses were added as a
quarter of a row holds, so old popularity fades and the rows never fill up. Costs one C call
per request (runtime/_cache_core.c: a few vectorised operations per request in Python cost as
much as the cache's own work); the numpy code below is the reference and the fallback.

With `timed`, it also remembers when a key was last used (the request count, in two rows of
32-bit stamps under the same slots; a key's stamp is the older of its two, so a collision can
only make it look recent): `add` then says how many requests ago each key was used before,
which tells a policy whether a block's reuse comes back within what the cache can hold.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

try:
    from ._cache_core import (sketch_add as _add_c, sketch_count as _count_c, sketch_raise as _raise_c,
                              sketch_stamp as _stamp_c)
except ImportError:  # not built (a checkout used without `python setup.py build_ext --inplace`)
    _add_c = _count_c = _raise_c = _stamp_c = None

MIN_BITS, MAX_BITS = 16, 24
SLOTS_PER_NODE = 64
_SPREAD = np.uint64(0x9E3779B97F4A7C15)  # odd: a bijection on 64-bit words


class UseSketch:
    """Approximate per-key use counts (0..255) over the recent past of a cache of `nodes` nodes."""

    __slots__ = ("_mask", "_rows", "_r0", "_r1", "_int_mask", "_added", "_halve_at", "_stamps", "_s0", "_s1", "_now")

    def __init__(self, nodes: int, timed: bool = False):
        bits = min(MAX_BITS, max(MIN_BITS, (SLOTS_PER_NODE * nodes - 1).bit_length()))
        self._mask = np.uint64((1 << bits) - 1)
        self._int_mask = (1 << bits) - 1
        self._rows = np.zeros((2, 1 << bits), dtype=np.uint8)
        self._r0, self._r1 = self._rows  # views, for the C functions
        self._added = 0
        self._halve_at = (1 << bits) // 4
        # request count of each slot's latest use (0: none yet), only when timed
        self._stamps = np.zeros((2, 1 << bits), dtype=np.uint32) if timed else None
        self._s0, self._s1 = self._stamps if timed else (None, None)
        self._now = 0

    def _slots(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Two slots per key. Block keys are 16-byte digests (runtime/hashing.py): their first 8
        bytes are already uniform; other keys are hashed (crc32, spread over 64 bits). Never
        Python's `hash`, which changes from run to run: the same trace gives the same counts."""
        joined = b"".join(keys)
        if len(joined) == 16 * len(keys):
            h = np.frombuffer(joined, dtype=np.uint64)[::2]
        else:
            h = np.fromiter(map(zlib.crc32, keys), dtype=np.uint64, count=len(keys)) * _SPREAD
        return h & self._mask, (h >> np.uint64(32)) & self._mask

    def add(self, keys: Sequence[bytes]) -> np.ndarray | None:
        """Count one use of each of `keys` (distinct keys: one request's). Timed: returns how
        many requests ago each key was used before (int64; -1: never, as far as the stamps
        know), else None."""
        if not len(keys):
            return np.empty(0, dtype=np.int64) if self._stamps is not None else None
        ages = self._stamp(keys) if self._stamps is not None else None
        if _add_c is None or not _add_c(self._r0, self._r1, keys, self._int_mask):
            self._bump(*self._slots(keys))
        self._added += len(keys)
        if self._added >= self._halve_at:
            self._rows >>= 1
            self._added = 0
        return ages

    def _stamp(self, keys: Sequence[bytes]) -> np.ndarray:
        """How many requests ago each key was used before (-1: never); stamps them now."""
        self._now += 1
        ages = np.empty(len(keys), dtype=np.int64)
        if _stamp_c is not None and _stamp_c(self._s0, self._s1, keys, self._int_mask, self._now, ages):
            return ages
        a, b = self._slots(keys)
        s0, s1 = self._s0, self._s1
        last = np.minimum(s0[a], s1[b]).astype(np.int64)
        ages = np.where(last > 0, self._now - last, -1)
        s0[a] = self._now
        s1[b] = self._now
        return ages

    def _bump(self, a: np.ndarray, b: np.ndarray) -> None:
        r0, r1 = self._r0, self._r1
        r0[a] = np.minimum(r0[a], 254) + 1
        r1[b] = np.minimum(r1[b], 254) + 1

    def count(self, keys: Sequence[bytes]) -> np.ndarray:
        """The use counts of `keys` (int32; may overestimate, never underestimates a key added
        since the last halving)."""
        if _count_c is not None:
            out = np.empty(len(keys), dtype=np.int32)
            if _count_c(self._r0, self._r1, keys, self._int_mask, out):
                return out
        a, b = self._slots(keys)
        return np.minimum(self._r0[a], self._r1[b]).astype(np.int32)

    def raise_hits(self, keys: Sequence[bytes], hits: np.ndarray, nodes: np.ndarray, cap: int | None) -> bool:
        """Raise `hits[nodes]` (an int32 row) to the counts of their `keys` minus one, each
        capped by `cap` (None: no cap) and by the keys before it, at least 0, in one C call;
        False (nothing changed) where that cannot be done (not built, keys not 16 bytes): the
        caller then does it with `count`."""
        return _raise_c is not None and _raise_c(self._r0, self._r1, keys, self._int_mask, hits, nodes, cap)
