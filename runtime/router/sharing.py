"""Which leading blocks of a prompt other prompts share: the router's own record of the prompts'
shape, next to what the nodes' KV events say they hold.

Why: a node that holds a request's prefix may hold it for two reasons, and they call for
different routing. A conversation's own history (blocks no other prompt has) exists once in the
fleet: sending its next turn anywhere else loses all of it, so it follows its node. A prefix many
prompts share (a system prompt, a tool list, a document asked many questions) is worth copying:
one more node holding it costs writing it once, and pinning every prompt under it to the one
node that held it first piles all of them on that node, whose pool then churns and evicts the
rest while the others sit idle.

How: the router sees every prompt's chained block keys (a key stands for the whole prefix up to
its block), so a key seen followed by two different keys is where prompts part: everything up
to it is shared. A prompt ending at a key does not make it shared (the next turn of the same
conversation continues it). Memory is bounded by keeping two generations of at most `capacity`
keys each: a key not seen for a generation is forgotten (and counts as unshared again).
"""
from __future__ import annotations

from typing import Sequence

CAPACITY = 1 << 18  # keys per generation (two generations: 16-byte keys, some tens of MiB at most)
_BRANCH = b""       # the next-key mark of a key seen followed by two different keys (a key is never empty)


class Sharing:
    """Branch points of the prompts seen, by chained block key."""

    def __init__(self, capacity: int = CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._new: dict[bytes, bytes | None] = {}  # key -> the key seen after it (None: none yet; _BRANCH: several)
        self._old: dict[bytes, bytes | None] = {}

    def _get(self, key: bytes) -> bytes | None | bool:
        """The key's next-key mark, or False when it was not seen."""
        got = self._new.get(key, False)
        if got is False:
            got = self._old.get(key, False)
        return got

    def shared(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` some other prompt seen had too, up to where they parted (0:
        none, or only prompts this one continues)."""
        depth = 0
        for i in range(len(keys) - 1):
            nxt = self._get(keys[i])
            if nxt is False:
                break
            if nxt == _BRANCH or (nxt is not None and nxt != keys[i + 1]):
                depth = i + 1
        return depth

    def observe(self, keys: Sequence[bytes]) -> None:
        """Record a prompt's keys (after `shared` was asked for it)."""
        new = self._new
        for i, k in enumerate(keys):
            nxt = keys[i + 1] if i + 1 < len(keys) else None
            got = new.get(k, False)
            if got is False:
                got = self._old.get(k, False)
            if got is False or got is None:
                mark = nxt
            elif nxt is None or got == nxt:
                mark = got
            else:
                mark = _BRANCH
            new[k] = mark
        if len(new) > self.capacity:
            self._old, self._new = new, {}
