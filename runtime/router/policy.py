"""How the router picks a backend for a request.

Why cache-aware: a node that already holds a request's prefix (its KV events say which block
keys it holds) skips that prefill, so a conversation's later turns should go where its earlier
turns went. Pure affinity makes one node hot (every turn of a popular system prompt lands on
it), so affinity counts only among nodes whose in-flight requests exceed the least loaded one's
by at most a margin: past it, a node loses its affinity and the request goes elsewhere (and
warms a second node's cache).

Why the rest, for pools under pressure: what a node will hold next is what it is sent now, so
the nodes' caches together hold the most of the working set when each prefix lives on one node
and new prefixes are spread so that every node writes about as much. The nodes' churn is the
blocks each was sent and did not hold, decayed by INFLOW_DECAY per request (what evicts).
Counting a request's size rather than requests matters when prompts differ in length: a node
sent a few long one-off prompts has evicted as much as one sent many short ones.

- A request of which no node holds more than a sliver (AFFINITY_SHARE of its blocks) is a new
  prefix: it goes to the node with the least churn. Anything more is a hit worth taking now (a
  conversation whose node evicted the tail of its history still hits the head there).
- A request of which the nodes hold no more than other prompts share too (runtime/router/
  sharing.py: a system prompt, a tool list, a document; not a conversation's own history) follows
  the node holding it only while that node's churn stays below 1 + COPY_SLACK times the least
  churning node's plus the blocks a copy there would write; past that it goes there and the
  shared prefix is copied. Otherwise every prompt under one shared prefix piles onto the node
  that held it first (agent loops over one tool list: all on one node), whose pool churns and
  evicts them all while the other nodes idle; and a node that idles is never worth a copy when
  the slack is a share of the fleet's mean churn rather than of the idle node's own.
- Any other request follows the node holding the most of it.

Ties go to the least loaded, then round-robin, so an idle fleet is still spread.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from kvrt.runtime.router.sharing import Sharing

POLICIES = ("cache-aware", "round-robin", "least-load")
AFFINITY_SHARE = 0.1   # a prefix held for at most this share of a request's blocks does not bind
COPY_SLACK = 0.5       # how far ahead of the least churn (a share of it) a node holding only shared blocks may churn
INFLOW_DECAY = 0.99    # per request routed: a node's written blocks count for about the last 100


@dataclass
class Candidate:
    """One healthy backend as a policy sees it: its index, requests in flight through the
    router, how many leading blocks of this request it holds (a block on a slower tier counts
    for less), and the request's full blocks (0: not known)."""

    index: int
    load: int
    cached_blocks: float = 0
    blocks: int = 0


class Picker:
    """Chooses among candidates by `policy`; holds the round-robin cursor and, for cache-aware,
    the new blocks each backend was recently sent and where the prompts seen part."""

    def __init__(self, policy: str, load_margin: int = 4):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
        if load_margin < 0:
            raise ValueError(f"load margin must be >= 0, got {load_margin}")
        self.policy = policy
        self.load_margin = load_margin
        self._turn = itertools.count()
        self.inflow: dict[int, float] = {}  # backend index -> new blocks sent to it, decayed
        self.sharing = Sharing()

    def pick(self, cands: Sequence[Candidate], keys: Sequence[bytes] = ()) -> Candidate:
        """The backend for one request (`cands` is never empty); `keys`: its block keys (any
        backend's: only their shape is used), for what other prompts share of it."""
        if not cands:
            raise ValueError("no candidate backend")
        shared = self.sharing.see(keys) if keys and self.policy == "cache-aware" else 0
        start = next(self._turn)
        order = [cands[(start + i) % len(cands)] for i in range(len(cands))]  # ties: round-robin
        if self.policy == "round-robin":
            return order[0]
        least = min(c.load for c in cands)
        if self.policy == "least-load":
            return next(c for c in order if c.load == least)
        eligible = [c for c in order if c.load <= least + self.load_margin]
        inflow = self.inflow
        best = max(eligible, key=lambda c: (c.cached_blocks, -inflow.get(c.index, 0.0), -c.load))
        if best.blocks and best.cached_blocks <= AFFINITY_SHARE * best.blocks:  # a new prefix: spread it
            best = min(eligible, key=lambda c: (inflow.get(c.index, 0.0), c.load))
        elif best.cached_blocks <= shared:  # only what other prompts share: copied off a node that churns far more
            low = min(eligible, key=lambda c: (inflow.get(c.index, 0.0), c.load))
            least_churn = inflow.get(low.index, 0.0)
            if inflow.get(best.index, 0.0) > (1 + COPY_SLACK) * least_churn + best.cached_blocks - low.cached_blocks:
                best = low
        for i in inflow:
            inflow[i] *= INFLOW_DECAY
        inflow[best.index] = inflow.get(best.index, 0.0) + max(0.0, best.blocks - best.cached_blocks)
        return best
