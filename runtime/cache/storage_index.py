"""The engine's index of the storage tier: which block keys every rank's storage holds.

A node-local tier (`file:DIR`): matching runs on the engine's hot path, once per request, and
must not wait for another process. The ranks list their keys once at start-up (StorageKeys);
after that the engine knows what it wrote (GPU2STORAGE done) and forgets keys a read found
missing or corrupt, so a lookup is a few set probes. A key counts only when every rank has it:
a block is usable only if all of its head shards can be read.

A shared tier (`mooncake://`): other nodes write into it all the time, so a listing is stale
at once. The engine cannot ask the store itself without blocking its loop, so the read is the
lookup: `lookup` answers "maybe all of them", matching asks the cache-transfer ranks to read
every key the tree lacks (one STORAGE2GPU task, which starts with a batched existence check in
the store), and the request waits for the answer in the scheduler (LOADING, like a swap-in).
The answer says how many leading blocks every rank read; the rest are computed. A task that
does not come back within the rank timeout is a miss. Reads never trust the index: objects are
checksummed (file) or sized (Mooncake), and a short read recomputes the rest.

Either way `known` says which keys this node has seen stored (wrote or read), so it does not
write a block again that it knows the tier holds.

A prefix-cache reset (`reset`) makes a node-local tier's index forget every key, so the node
reads none of those objects again: the objects stay on disk (the directory may be other nodes'
too, its cap's eviction reclaims them, and a restarted node lists them again), and what the
storage tasks in flight at the reset report is not learnt. A shared store is left as it is: it
belongs to several nodes, and one node's reset must not take their blocks away.
"""
from __future__ import annotations

from typing import Iterable, Sequence


class StorageIndex:
    def __init__(self, ranks: int, shared: bool = False):
        self._keys: set[bytes] = set()
        self._listing: dict[int, set[bytes]] = {}
        self._listed: set[int] = set()
        self._stale: set[int] = set()  # storage tasks in flight at a reset of a node-local tier
        self._listing_stale = False     # a reset came before the start-up listing was complete
        self.ranks = ranks
        self.shared = shared

    @property
    def ready(self) -> bool:
        """True once every rank has listed its storage."""
        return len(self._listed) == self.ranks

    def __len__(self) -> int:
        return len(self._keys)

    def listed(self, rank: int, keys: Iterable[bytes], last: bool) -> None:
        """A batch of rank `rank`'s start-up listing; the index takes the keys all ranks have."""
        if not self._listing_stale:
            self._listing.setdefault(rank, set()).update(keys)
        if not last:
            return
        self._listed.add(rank)
        if self.ready:
            common = set.intersection(*self._listing.values()) if self._listing else set()
            self._keys |= common
            self._listing.clear()

    def reset(self, in_flight: Iterable[int]) -> int:
        """The prefix cache was reset (see the module docstring); `in_flight`: the storage tasks
        it had in flight. Returns how many keys were forgotten."""
        if self.shared:
            return 0
        gone = len(self._keys)
        self._keys.clear()
        self._listing.clear()  # a listing under way lists objects from before the reset too
        self._listing_stale = not self.ready
        self._stale.update(in_flight)
        return gone

    def from_before_reset(self, task_id: int) -> bool:
        """Was this storage task in flight at a reset (so its result must not be learnt)? Asked
        once per task, when its result comes."""
        if task_id in self._stale:
            self._stale.discard(task_id)
            return True
        return False

    def keys(self) -> list[bytes]:
        """Every key this node knows the tier holds."""
        return list(self._keys)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are worth a read: those the index holds, or for a shared
        tier all of them (the read finds out)."""
        return len(keys) if self.shared else self.known(keys)

    def known(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` this node knows the tier holds."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Iterable[bytes]) -> list[bytes]:
        """Record `keys` as stored; the ones this index did not know yet (for KV events)."""
        new = [k for k in keys if k not in self._keys]
        self._keys.update(new)
        return new

    def forget(self, keys: Iterable[bytes]) -> list[bytes]:
        """Drop `keys`; the ones this index knew (a shared tier's misses are mostly unknown)."""
        gone = [k for k in keys if k in self._keys]
        self._keys.difference_update(gone)
        return gone
