"""A request trace's shape in aggregate, the statistics the development suite's families are
made to match (bench/synthetic.py `sessions`): what share of block accesses are one-time, how
often a block's first use comes back, how concentrated reuse is, how well a block's last reuse
gap predicts its next, how many distinct roots and how long the prompts are, and the quartiles
of reuse (LRU stack) distances. Blocks are `block_size`-token blocks of the Mooncake format's
512-token ids (runtime/client/trace.py); time is counted in requests.
"""
from __future__ import annotations

import numpy as np

from kvrt.runtime.client.trace import TRACE_BLOCK, TraceRequest


def blocks(req: TraceRequest, block_size: int = 64) -> list[int]:
    """The request's full blocks, as ids: equal ids are equal prefixes."""
    per = TRACE_BLOCK // block_size
    return [req.hash_ids[b // per] * per + b % per for b in range(req.input_length // block_size)]


def shape(requests: list[TraceRequest], block_size: int = 64) -> dict[str, float]:
    """one_time_access_share: accesses to blocks used once / all block accesses;
    first_use_back: distinct blocks used at least twice / distinct blocks;
    used5_share, used5_reuse_share: distinct blocks used 5 times or more, and their share of all
    reuses (uses after the first); gap_correlation: the correlation of consecutive reuse gaps of
    a block, in log requests; distinct_first_blocks, requests, mean_blocks: roots, requests and
    full blocks per prompt."""
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    gap: dict[int, float] = {}
    pairs: list[tuple[float, float]] = []
    for t, r in enumerate(requests):
        for k in blocks(r, block_size):
            uses[k] = uses.get(k, 0) + 1
            if k in last:
                g = float(np.log(t - last[k])) if t > last[k] else 0.0
                if k in gap:
                    pairs.append((gap[k], g))
                gap[k] = g
            last[k] = t
    u = np.fromiter(uses.values(), dtype=np.int64, count=len(uses))
    accesses = int(u.sum())
    reuses = u - 1
    x = np.array(pairs, dtype=np.float64).reshape(-1, 2)
    corr = float(np.corrcoef(x[:, 0], x[:, 1])[0, 1]) if len(x) > 2 and x.std(axis=0).all() else float("nan")
    return {"one_time_access_share": float(u[u == 1].sum() / accesses) if accesses else 0.0,
            "first_use_back": float((u >= 2).mean()) if len(u) else 0.0,
            "used5_share": float((u >= 5).mean()) if len(u) else 0.0,
            "used5_reuse_share": float(reuses[u >= 5].sum() / reuses.sum()) if reuses.sum() else 0.0,
            "gap_correlation": corr,
            "distinct_first_blocks": float(len({r.hash_ids[0] for r in requests})),
            "requests": float(len(requests)),
            "mean_blocks": float(np.mean([r.input_length / block_size for r in requests])) if requests else 0.0}


def stack_quartiles(requests: list[TraceRequest], block_size: int = 64) -> np.ndarray:
    """Quartiles of the LRU stack distance of every reuse: the distinct blocks used since the
    block's last use, counted a request at a time (a Fenwick tree over request times holds, per
    request, the blocks whose last use it is)."""
    n = len(requests)
    tree = np.zeros(n + 1, dtype=np.int64)

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def before(i: int) -> int:  # blocks whose last use is a request before i
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return int(s)

    last: dict[int, int] = {}
    live = 0
    dist = []
    for t, r in enumerate(requests):
        ks = blocks(r, block_size)
        dist += [live - before(last[k] + 1) for k in ks if k in last]
        for k in ks:
            if k in last:
                add(last[k], -1)
                live -= 1
            last[k] = t
        add(t, len(ks))
        live += len(ks)
    return np.percentile(dist, [25, 50, 75]) if dist else np.zeros(3)
