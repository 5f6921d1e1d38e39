"""The ownership rule's one check, shared by the engine (before it hands blocks over) and by
the process that receives an order (before it touches them).

Every block has one owner at a time and only the engine changes it, by sending an order; in
debug mode (KVRT_CHECK_OWNERSHIP=1) each block's owner is an int32 in a shared array. Both
halves of a node import this module (runtime/ and workers/ never import each other), so a
violation reads the same and is caught as the same class wherever it is found.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from kvrt.ipc.protocol import OWNER_NAMES


class OwnershipError(AssertionError):
    """An order broke the ownership rule: a bug in whoever gave it, never bad input. Names the
    order, the first wrong block, its owner and the owners it should have had."""


def check_owners(owners: np.ndarray, blocks: np.ndarray, tier: str, order: str,
                 allowed: int | Iterable[int]) -> None:
    """Raise OwnershipError unless every block in `blocks` is owned by one of `allowed`.

    `order` names the order in the message (`task 3 (swap2cpu) on cache-transfer[0]`)."""
    allowed = (allowed,) if isinstance(allowed, (int, np.integer)) else tuple(allowed)
    blocks = np.asarray(blocks, dtype=np.int64)
    got = owners[blocks]
    bad = np.flatnonzero(~np.isin(got, allowed))
    if not bad.size:
        return
    b, o = int(blocks[bad[0]]), int(got[bad[0]])
    names = " or ".join(OWNER_NAMES.get(a, f"owner {a}") for a in sorted(allowed)) or "nobody"
    raise OwnershipError(
        f"ownership violation in {order}: {tier} block {b} is owned by "
        f"{OWNER_NAMES.get(o, f'unknown owner {o}')}, not {names} "
        f"({bad.size} of {got.size} blocks wrong: {blocks[bad[:8]].tolist()})")
