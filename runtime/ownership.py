"""The ownership rule's race detector (KVRT_CHECK_OWNERSHIP=1).

Every block has one owner at a time (ARCHITECTURE.md §3) and only the engine changes it, by
sending an order. In debug mode the engine records each block's owner in a shared int32
array and checks every hand-over against the owners it may come from; the process that
receives an order checks it really owns the blocks before touching them. A wrong order
(swapping out a block the worker is computing into, say) fails loudly at once instead of
producing silently wrong KV, the bug class the reference system's lock used to hide.
"""
from __future__ import annotations

import numpy as np

from ipc import protocol as P


class OwnershipError(AssertionError):
    """A hand-over broke the ownership rule; names the blocks, their owners and the order."""


# which owner a block may come from when the engine hands it to a cache-transfer rank
TASK_SOURCES = {
    P.SWAP2CPU: ({P.OWNER_CACHE}, {P.OWNER_FREE}),            # (device blocks, host blocks)
    P.SWAP2GPU: ({P.OWNER_FREE}, {P.OWNER_CACHE}),
    P.STORAGE2GPU: ({P.OWNER_FREE}, set()),
    P.GPU2STORAGE: ({P.OWNER_CACHE}, set()),
}


class OwnerTable:
    """Owners of one tier's blocks (an int32 signal shared with the other processes)."""

    def __init__(self, array: np.ndarray, tier: str):
        self.owners = array
        self.tier = tier

    def hand_over(self, blocks: np.ndarray, to: int, allowed_from: set[int], order: str) -> None:
        """Give `blocks` to `to`; raise OwnershipError if any is not held by an allowed owner."""
        if len(blocks) == 0:
            return
        blocks = np.asarray(blocks)
        current = self.owners[blocks]
        bad = ~np.isin(current, list(allowed_from))
        if bad.any():
            i = int(np.argmax(bad))
            raise OwnershipError(
                f"{order}: {self.tier} block {int(blocks[i])} is owned by {P.OWNER_NAMES[int(current[i])]}, "
                f"may only come from {sorted(P.OWNER_NAMES[o] for o in allowed_from)} to go to "
                f"{P.OWNER_NAMES[to]} ({int(bad.sum())} block(s) wrong)")
        self.owners[blocks] = to

    def owned_by(self, blocks: np.ndarray, owner: int) -> bool:
        return bool((self.owners[np.asarray(blocks)] == owner).all())
