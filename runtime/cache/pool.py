"""Free block ids of one KV tier (device or host).

Why a plain list used as a stack: allocating n blocks is one slice and one `del` at the end of
the list, and freeing a batch is one `extend`, so both cost O(1) per block in C. The reference
system pushed freed blocks onto a heap one at a time inside its eviction loop, which made
eviction slow; callers here collect the blocks an operation frees and return them in one call. Which block ids are handed out does not matter for KV, so no ordering is kept beyond
"most recently freed first" (warm in cache, for what it is worth).
"""
from __future__ import annotations

from typing import Iterable


class BlockPool:
    """The free list of one tier: `allocate(n)` and `free(blocks)` in O(1) per block."""

    __slots__ = ("tier", "num_blocks", "_free", "ids")

    def __init__(self, tier: str, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"{tier} pool: num_blocks must be >= 0, got {num_blocks}")
        self.tier = tier
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # block 0 is handed out first
        # ids[b] is the int b, made once: eviction hands freed blocks back as these objects
        # (runtime/cache/_cache_core.c drop_run) rather than a new int per block, which the
        # request it goes to would free again when it ends
        self.ids = self._free[::-1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; raises ValueError if fewer are free (callers check first)."""
        free = self._free
        if n > len(free):
            raise ValueError(f"{self.tier} pool: {n} blocks asked, {len(free)} free")
        if n <= 0:
            return []
        out = free[-n:]
        del free[-n:]
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return a batch of blocks."""
        self._free.extend(blocks)

    def free_blocks(self) -> list[int]:
        """A copy of the free list (for the invariant checker)."""
        return list(self._free)
