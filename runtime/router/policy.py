"""How the router picks a backend for a request.

Why cache-aware: a node that already holds a request's prefix (its KV events say which block
keys it holds) skips that prefill, so a conversation's later turns should go where its earlier
turns went. Pure affinity makes one node hot (every turn of a popular system prompt lands on
it), so affinity counts only among nodes whose in-flight requests exceed the least loaded one's
by at most a margin: past it, a node loses its affinity and the request goes elsewhere (and
warms a second node's cache). With nothing cached anywhere the least loaded node wins; ties go
round-robin so an idle fleet is still spread.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

POLICIES = ("cache-aware", "round-robin", "least-load")


@dataclass
class Candidate:
    """One healthy backend as a policy sees it: its index, requests in flight through the
    router, and how many leading blocks of this request it holds."""

    index: int
    load: int
    cached_blocks: int = 0


class Picker:
    """Chooses among candidates by `policy`; holds only the round-robin cursor."""

    def __init__(self, policy: str, load_margin: int = 4):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
        if load_margin < 0:
            raise ValueError(f"load margin must be >= 0, got {load_margin}")
        self.policy = policy
        self.load_margin = load_margin
        self._turn = itertools.count()

    def pick(self, cands: Sequence[Candidate]) -> Candidate:
        """The backend for one request (`cands` is never empty)."""
        if not cands:
            raise ValueError("no candidate backend")
        start = next(self._turn)
        order = [cands[(start + i) % len(cands)] for i in range(len(cands))]  # ties: round-robin
        if self.policy == "round-robin":
            return order[0]
        least = min(c.load for c in cands)
        if self.policy == "least-load":
            return next(c for c in order if c.load == least)
        eligible = [c for c in order if c.load <= least + self.load_margin]
        return max(eligible, key=lambda c: (c.cached_blocks, -c.load))
