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
keys each: a key not seen for a generation is forgotten (and counts as unshared again). The
work per prompt is a few list passes over its keys (no Python-level branch per key but where
prompts part): the router does it for every request.
"""
from __future__ import annotations

from typing import Sequence

CAPACITY = 1 << 18  # keys per generation (two generations: 16-byte keys, some tens of MiB at most)
_BRANCH = b""       # the next-key mark of a key seen followed by two different keys (a key is never empty)
_UNSEEN = object()


class Sharing:
    """Branch points of the prompts seen, by chained block key."""

    def __init__(self, capacity: int = CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._new: dict[bytes, bytes | None] = {}  # key -> the key seen after it (None: none yet; _BRANCH: several)
        self._old: dict[bytes, bytes | None] = {}

    def see(self, keys: Sequence[bytes]) -> int:
        """Record a prompt's keys; returns how many of its leading keys some prompt seen before
        had too, up to where they parted (0: none, or only prompts this one continues)."""
        n = len(keys)
        if n == 0:
            return 0
        new, old, unseen = self._new, self._old, _UNSEEN
        get = new.get
        marks = [get(k, unseen) for k in keys]
        if old:
            get = old.get
            marks = [get(k, unseen) if m is unseen else m for k, m in zip(keys, marks)]
        nexts = keys[1:]
        # where this prompt parts from one seen: the key was followed by another key than here
        parts = [i for i, (m, nk) in enumerate(zip(marks, nexts)) if m is not unseen and m is not None and m != nk]
        try:
            walk = marks.index(unseen)  # a key's descendants count only through keys seen (they are chained)
        except ValueError:
            walk = n
        depth = 0
        for i in reversed(parts):
            if i < walk:
                depth = i + 1
                break
        new.update(zip(keys, nexts))
        for i in parts:
            new[keys[i]] = _BRANCH
        last = marks[-1]
        new[keys[-1]] = None if last is unseen else last
        if len(new) > self.capacity:
            self._old, self._new = new, {}
        return depth
