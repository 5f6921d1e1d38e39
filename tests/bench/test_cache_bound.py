"""`kvrt bench cache`'s offline bound (bench/belady.py), its policy and LRU columns, and the
synthetic traces (bench/synthetic.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvrt.bench.belady import offline_hit_rate, uses
import kvrt.bench.cache as cache_bench
from kvrt.bench.synthetic import TRACES, synthetic
from kvrt.runtime.client.trace import TRACE_BLOCK, TraceRequest, ideal_hit_tokens


def random_trace(seed: int, n: int) -> list[TraceRequest]:
    """Requests over a few shared id prefixes that branch and grow, like conversations."""
    rng = np.random.default_rng(seed)
    prefixes: list[tuple[int, ...]] = [(0,), (1, 2)]
    fresh = 10
    out = []
    for t in range(n):
        base = prefixes[int(rng.integers(len(prefixes)))]
        base = base[:int(rng.integers(1, len(base) + 1))]
        extra = tuple(range(fresh, fresh + int(rng.integers(1, 4))))
        fresh += len(extra)
        ids = base + extra
        prefixes.append(ids)
        length = (len(ids) - 1) * TRACE_BLOCK + int(rng.integers(1, TRACE_BLOCK + 1))
        out.append(TraceRequest(t, length, 1, ids))
    return out


def naive_bound(reqs: list[TraceRequest], bs: int, capacity: int) -> float:
    """Belady with the prefix constraint, the slow obvious way: blocks are (id prefix, offset)
    tuples; when room is needed, scan the future for every unpinned cached leaf's next use and
    evict the farthest."""
    per = TRACE_BLOCK // bs
    paths = []
    for r in reqs:
        full = r.input_length // bs
        paths.append([(r.hash_ids[:b // per + 1], b % per) for b in range(full)])
    parent = {}
    for p in paths:
        for i, b in enumerate(p):
            parent[b] = p[i - 1] if i else None
    cached: set = set()
    hits = 0
    for t, (r, path) in enumerate(zip(reqs, paths)):
        limit = min(len(path), (r.input_length - 1) // bs)
        hit = 0
        while hit < len(path) and path[hit] in cached:
            hit += 1
        hits += min(hit, limit) * bs
        need = -(-r.input_length // bs) - min(hit, limit)
        if need + hit > capacity:
            continue
        pinned = set(path[:hit])
        while len(cached) + need > capacity:
            has_child = {parent[b] for b in cached}
            leaves = [b for b in cached if b not in has_child and b not in pinned]

            def next_use(b, t=t):
                return next((u for u in range(t + 1, len(paths)) if b in paths[u]), len(paths))
            cached.discard(max(leaves, key=next_use))
        cached.update(path)
    return hits / sum(r.input_length for r in reqs)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bs", [128, 512])
def test_offline_bound_matches_a_naive_belady(seed, bs):
    reqs = random_trace(seed, 60)
    u = uses(reqs, bs)
    blocks = sum(-(-r.input_length // bs) for r in reqs)
    for capacity in (8, 20, 40, blocks):
        assert offline_hit_rate(u, bs, capacity) == pytest.approx(naive_bound(reqs, bs, capacity), abs=1e-12)


def test_bound_is_above_every_policy_and_at_most_the_ideal():
    reqs = random_trace(7, 300)
    bs = 128
    u = uses(reqs, bs)
    ideal = ideal_hit_tokens(reqs, bs) / sum(r.input_length for r in reqs)
    assert offline_hit_rate(u, bs, 10 ** 9) == pytest.approx(ideal)
    for capacity in (16, 48, 128):
        bound = offline_hit_rate(u, bs, capacity)
        assert bound <= ideal + 1e-12
        for policy in ("lru", "reuse"):
            assert cache_bench.replay(reqs, bs, capacity, 0, policy)["hit_token_rate"] <= bound + 1e-12


def test_cli_policy_rows_with_lru_and_bound(capsys):
    rc = cache_bench.main(["--trace", "synthetic:chats", "--limit", "300", "--capacity-blocks", "500",
                           "--eviction", "reuse", "lru", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = json.loads(out)["results"]
    assert [r["policy"] for r in rows] == ["reuse", "lru"]
    lru = rows[1]["hit_token_rate"]
    for r in rows:
        assert r["lru_hit_token_rate"] == lru
        assert max(r["hit_token_rate"], lru) <= r["offline_bound_hit_token_rate"] <= r["ideal_hit_token_rate"]


def test_cli_table_names_the_columns(capsys):
    rc = cache_bench.main(["--trace", "synthetic:agents", "--limit", "200", "--capacity-blocks", "800",
                           "--eviction", "reuse"])
    out = capsys.readouterr().out
    assert rc == 0
    head = out.splitlines()[2].split()
    assert head[:4] == ["capacity", "host", "policy", "hit"] and "LRU" in head and "bound" in head
    assert " reuse " in out.splitlines()[4]


@pytest.mark.parametrize("name", sorted(TRACES))
def test_synthetic_traces_are_fixed_and_valid(name):
    a, b = synthetic(name), synthetic(name)
    assert a == b and len(a) >= 1000
    for r in a:
        n = len(r.hash_ids)
        assert (n - 1) * TRACE_BLOCK < r.input_length <= n * TRACE_BLOCK
    assert ideal_hit_tokens(a, 64) > 0  # they share prefixes


def test_unknown_synthetic_trace_is_an_error(capsys):
    with pytest.raises(SystemExit):
        cache_bench.main(["--trace", "synthetic:nope"])
    assert "known synthetic traces are" in capsys.readouterr().err
