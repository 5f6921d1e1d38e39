"""The ownership rule's race detector (KVRT_CHECK_OWNERSHIP=1).

Every block has one owner at a time (no lock: who may touch it is carried by messages) and
only the engine changes it, by sending an order. In debug mode the engine keeps each block's owner in a shared int32 array:
before it sends anything it syncs the array from the prefix cache's own account of every
block (`PrefixCache.block_roles`), then checks each new hand-over against the owners it may
come from, and each step against what a step may touch; the process that receives an order
checks it really owns the blocks before touching them. A wrong order (swapping out a block the
worker is computing into, recording a block before its KV is written, scheduling a block that
is still being swapped in) fails loudly at once instead of producing silently wrong KV, the
bug class a cross-process lock would hide.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.ownership import OwnershipError, check_owners
from kvrt.runtime.cache import prefix_cache as pc

if TYPE_CHECKING:
    from kvrt.runtime.cache.prefix_cache import PrefixCache
    from kvrt.runtime.engine.scheduler import Scheduler
    from kvrt.runtime.pd.connector import KVConnector


def _sources(kind: P.TaskKind, tier: str) -> set[int]:
    """The owners a task's blocks of `tier` may come from: a tier it reads gives tree blocks, a
    tier it writes free ones, and it has no blocks of any other tier."""
    return {P.OWNER_CACHE} if kind.reads == tier else {P.OWNER_FREE} if kind.writes == tier else set()


# which owner a block may come from when the engine hands it to a cache-transfer rank:
# kind -> (device blocks, host blocks), from the task kind table
TASK_SOURCES = {kind: (_sources(kind, "device"), _sources(kind, "host")) for kind in P.TaskKind}


# the owner each block role means; blocks a task reads are the task's until it answers too
ROLE_OWNERS = np.array([0] * 5, dtype=np.int32)
ROLE_OWNERS[[pc.ROLE_FREE, pc.ROLE_TREE, pc.ROLE_PRIVATE, pc.ROLE_LOADING, pc.ROLE_SAVING]] = [
    P.OWNER_FREE, P.OWNER_CACHE, P.OWNER_WORKER, P.OWNER_TRANSFER, P.OWNER_TRANSFER]


def check_step(roles: np.ndarray, writes: np.ndarray, reads: np.ndarray, order: str) -> None:
    """A step may write only blocks private to its requests and read only written ones
    (tree blocks, its own, or tree blocks a task is copying out), never a block being filled."""
    for blocks, allowed, what in ((writes, (pc.ROLE_PRIVATE,), "write"),
                                  (reads, (pc.ROLE_TREE, pc.ROLE_PRIVATE, pc.ROLE_SAVING), "read")):
        bad = ~np.isin(roles[blocks], allowed)
        if bad.any():
            b = int(blocks[int(np.argmax(bad))])
            raise OwnershipError(f"{order}: would {what} device block {b}, which is "
                                 f"{_ROLE_NAMES[int(roles[b])]} ({int(bad.sum())} block(s) wrong)")


_ROLE_NAMES = {pc.ROLE_FREE: "free (never written)", pc.ROLE_TREE: "in the prefix tree (immutable)",
               pc.ROLE_PRIVATE: "private to a request", pc.ROLE_LOADING: "being filled by a transfer task",
               pc.ROLE_SAVING: "being copied out by a transfer task"}


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
        check_owners(self.owners, blocks, self.tier, f"{order} (handing it to {P.OWNER_NAMES[to]})", allowed_from)
        self.owners[blocks] = to

    def sync(self, roles: np.ndarray) -> None:
        """Set every block's owner from its role in the prefix cache (the engine's truth)."""
        self.owners[:] = ROLE_OWNERS[roles]


class OwnerSync:
    """The engine's side of the check: before each order it sends, set every block's owner from
    the prefix cache's account, marking the blocks others write (external KV arriving) or read
    (the connector's sends) as theirs. Without the shared tables (the check off) it does nothing."""

    def __init__(self, tables: tuple[OwnerTable, OwnerTable] | None, cache: PrefixCache,
                 sched: Scheduler, connector: KVConnector):
        self.tables = tables
        self._cache = cache
        self._sched = sched
        self._connector = connector

    def sync(self) -> np.ndarray | None:
        """Each device block's role as just synced, or None with the check off."""
        if self.tables is None:
            return None
        dev, host = self._cache.block_roles()
        dev[self._sched.incoming_blocks()] = pc.ROLE_LOADING  # written from outside: not ours to touch
        # read by the connector's ranks: no step may write them (tree blocks are immutable anyway,
        # and may be read by a cache-transfer task at the same time)
        out = np.asarray(self._connector.outgoing_blocks(), dtype=np.int64)
        dev[out[np.isin(dev[out], (pc.ROLE_FREE, pc.ROLE_PRIVATE))]] = pc.ROLE_SAVING
        self.tables[0].sync(dev)
        if len(host):
            self.tables[1].sync(host)
        return dev
