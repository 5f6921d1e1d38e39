"""The engine's index of the storage tier: which block keys every rank's storage holds.

Why an index instead of asking the ranks: matching runs on the engine's hot path, once per
request, and must not wait for another process. The ranks list their keys once at start-up
(StorageKeys); after that the engine knows what it wrote (GPU2STORAGE done) and forgets keys a
read found missing or corrupt, so a lookup is a few set probes. A key counts only when every
rank has it: a block is usable only if all of its head shards can be read. Objects written to
a shared store by other nodes after start-up are not seen until the next start (a miss, never
a wrong block: reads are checksummed and a short read recomputes the rest).
"""
from __future__ import annotations

from typing import Iterable, Sequence


class StorageIndex:
    def __init__(self, ranks: int):
        self._keys: set[bytes] = set()
        self._listing: dict[int, set[bytes]] = {}
        self._listed: set[int] = set()
        self.ranks = ranks

    @property
    def ready(self) -> bool:
        """True once every rank has listed its storage."""
        return len(self._listed) == self.ranks

    def __len__(self) -> int:
        return len(self._keys)

    def listed(self, rank: int, keys: Iterable[bytes], last: bool) -> None:
        """A batch of rank `rank`'s start-up listing; the index takes the keys all ranks have."""
        self._listing.setdefault(rank, set()).update(keys)
        if not last:
            return
        self._listed.add(rank)
        if self.ready:
            common = set.intersection(*self._listing.values()) if self._listing else set()
            self._keys |= common
            self._listing.clear()

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the storage tier holds."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Iterable[bytes]) -> None:
        self._keys.update(keys)

    def forget(self, keys: Iterable[bytes]) -> None:
        self._keys.difference_update(keys)
