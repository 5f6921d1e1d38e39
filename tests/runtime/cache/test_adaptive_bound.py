"""The default eviction policy's bound (runtime/cache/policies/adaptive.py): replayed beside an
LRU cache of the same size on generated traces, from a cold cache, it never serves fewer blocks
than LRU by more than the largest allowance it has had (a share of the capacity and of the
lookups, plus the lead `gaps`' order would have had over LRU, capped; that part can shrink), at
any request; so over any window of two turnovers, never more than the lead it had over LRU at
the window's start plus that allowance. The ledger behind it (gains and losses counted block by block)
is checked against the real difference too: it never counts the policy ahead of what it is."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.cache.policies.adaptive import Adaptive
from kvrt.runtime.cache.policies.base import make_policy
from kvrt.runtime.cache.prefix_cache import PrefixCache

BS = 4


def _trace(rng: np.random.Generator, requests: int, roots: int, most: int, shape: dict) -> list[np.ndarray]:
    """Requests of at most `most` blocks over `roots` prefixes: sessions that come back after random gaps, growing by a
    turn each time, between one-off prompts; the mix and the gaps are drawn per trace."""
    bases = [rng.integers(0, 1 << 20, 400).astype(np.int32) for _ in range(roots)]
    sessions: list[tuple[int, int]] = []  # (root, length in blocks)
    out = []
    for _ in range(requests):
        if sessions and rng.random() < shape["back"]:
            # which session comes back: recent ones (small gaps) or any (long gaps)
            k = len(sessions) - 1 - min(len(sessions) - 1, int(rng.geometric(shape["recent"])) - 1)
            root, length = sessions[k]
            length = min(most, length + int(rng.integers(1, 4)))
            sessions[k] = (root, length)
            out.append(bases[root][:length * BS + int(rng.integers(1, BS))])
        else:
            root = int(rng.integers(roots))
            length = int(rng.integers(2, max(3, min(most, shape["long"]))))
            sessions.append((root, length))
            sessions = sessions[-shape["live"]:]
            out.append(np.concatenate((bases[root][:length * BS // 2],
                                       rng.integers(0, 1 << 20, length * BS // 2 + 1).astype(np.int32))))
    return out


def _replay(trace: list[np.ndarray], capacity: int):
    """Both caches over the trace; per request: LRU's and the policy's cumulative device hits
    (blocks), the policy's lookups, budget, largest allowance so far, and its counted losses minus
    gains."""
    caches = [PrefixCache(BS, capacity, policy=make_policy("lru")), PrefixCache(BS, capacity, policy=Adaptive)]
    q = caches[1]._dev_lru
    hits = [0, 0]
    rows = []
    for i, tokens in enumerate(trace):
        keys = BlockHasher(BS).update(tokens)
        budget = q.budget()
        for j, c in enumerate(caches):
            hits[j] += c.match(i, keys, len(tokens)).device_tokens // BS
            assert c.allocate(i, len(tokens)) is not None
            c.update(i, len(tokens))
            c.release(i)
        most = max(rows[-1][4] if rows else 0.0, q.allowance())
        rows.append((hits[0], hits[1], q.lookups, budget, most, q.losses - q.gains))
    caches[1].check()
    return rows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), capacity=st.integers(24, 160), roots=st.integers(2, 12),
       back=st.floats(0.2, 0.9), recent=st.floats(0.02, 0.9), long=st.integers(4, 40), live=st.integers(2, 60))
def test_adaptive_never_trails_lru_by_more_than_its_allowance(seed, capacity, roots, back, recent, long, live):
    rng = np.random.default_rng(seed)
    trace = _trace(rng, 300, roots, capacity // 2 - 1, dict(back=back, recent=recent, long=long, live=live))
    rows = _replay(trace, capacity)
    for i, (lru, ours, lookups, budget, allowance, counted) in enumerate(rows):
        behind = lru - ours
        assert behind <= counted, f"request {i}: the ledger counts fewer losses than there are"
        assert behind <= allowance, f"request {i}: {behind} blocks behind LRU, allowance {allowance:.1f}"
    # any window of two turnovers (two capacities of blocks looked up): what it loses to LRU
    # there is at most the lead it had over LRU at the window's start plus its allowance, so a
    # window that starts level with LRU, as the first does, loses at most the allowance
    for s in range(len(rows)):
        l0, o0, k0 = rows[s][:3]
        for t in range(s + 1, len(rows)):
            l1, o1, k1, _, a1, _ = rows[t]
            if k1 - k0 > 2 * capacity:
                break
            behind = (l1 - l0) - (o1 - o0)
            assert behind <= (o0 - l0) + a1, f"window {s}..{t}: {behind} blocks behind LRU"
