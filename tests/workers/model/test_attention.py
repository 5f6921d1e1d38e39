"""Batched paged attention (workers/model/attention.py) must equal attending each sequence alone over
its own gathered context, whatever the grouping, padding, query tiles and key tiles; within a
sliding window too, where a plan never names a block that left every window of its rows (such a
block may be freed and rewritten: here it holds NaN), and with soft-capped scores."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrt.workers.model.attention import AttnShape, Span, paged_attention, plan_attention

LAYERS = 2


def make_pool(sh: AttnShape, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((num_blocks, LAYERS, 2, sh.block_size, sh.kv_heads, sh.head_dim))


def poison_unwritten(pool: np.ndarray, spans: list[Span], bs: int) -> None:
    """NaN in each sequence's last block past its context: slots a step must never read."""
    for sp in spans:
        ctx = sp.start + sp.n
        if ctx % bs:
            pool[sp.table[ctx // bs], :, :, ctx % bs:] = np.nan


def needed_blocks(spans: list[Span], bs: int, window: int) -> set[int]:
    """The blocks some query row of the batch sees keys in (with a window: from the first
    row's first key in it on)."""
    out: set[int] = set()
    for sp in spans:
        first = max(0, sp.start - window + 1) // bs if window else 0
        out.update(int(b) for b in sp.table[first:-(-(sp.start + sp.n) // bs)])
    return out


def poison_left_window(pool: np.ndarray, spans: list[Span], bs: int, window: int) -> None:
    """NaN in every slot no row of the batch sees: whole blocks that left every window, and the
    slots before the windows in the blocks they still reach."""
    seen = set()
    for sp in spans:
        for pos in range(sp.start, sp.start + sp.n):
            seen.update((int(sp.table[p // bs]), p % bs) for p in range(max(0, pos - window + 1), pos + 1))
    for b in {int(b) for sp in spans for b in sp.table}:
        for slot in range(bs):
            if (b, slot) not in seen:
                pool[b, :, :, slot] = np.nan


def reference(pool: np.ndarray, layer: int, q: np.ndarray, spans: list[Span], sh: AttnShape,
              window: int = 0) -> np.ndarray:
    """Each query row alone: softmax over its own visible keys (the last `window` of them,
    itself included, with a window), head by head."""
    grp, hd = sh.heads // sh.kv_heads, sh.head_dim
    out = np.zeros((q.shape[0], sh.heads * hd))
    for sp in spans:
        ctx = sp.start + sp.n
        k = pool[sp.table, layer, 0].reshape(-1, sh.kv_heads, hd)[:ctx]
        v = pool[sp.table, layer, 1].reshape(-1, sh.kv_heads, hd)[:ctx]
        for i in range(sp.n):
            row, seen = sp.row0 + i, sp.start + i + 1
            lo = max(0, seen - window) if window else 0
            for h in range(sh.heads):
                sc = k[lo:seen, h // grp] @ q[row, h]
                if sh.softcap:
                    sc = np.tanh(sc / sh.softcap) * sh.softcap
                p = np.exp(sc - sc.max())
                out[row, h * hd:(h + 1) * hd] = (p / p.sum()) @ v[lo:seen, h // grp]
    return out


def spans_of(shapes: list[tuple[int, int]], bs: int, perm: np.ndarray, share: list[int] | None = None) -> list[Span]:
    """Spans of (start, n), block tables cut from the permutation perm; share[i] blocks of
    span i are the previous span's first ones (a shared prefix)."""
    spans, row, used = [], 0, 0
    for i, (start, n) in enumerate(shapes):
        nblk = -(-(start + n) // bs)
        k = share[i] if share else 0
        own = perm[used:used + nblk - k]
        used += nblk - k
        table = np.concatenate([spans[-1].table[:k], own]) if k else own
        spans.append(Span(row, n, start, table.astype(np.int64)))
        row += n
    return spans


def run(pool, q, spans, sh, **kw) -> list[np.ndarray]:
    plan = plan_attention(spans, sh, **kw)
    if kw.get("window"):
        needed = needed_blocks(spans, sh.block_size, kw["window"])
        assert {int(b) for g in plan.groups for b in np.asarray(g.table).ravel()} <= needed, \
            "a windowed plan names a block that left every window"
    return [paged_attention(np, pool, li, q, plan, np.float64) for li in range(LAYERS)]


def check(pool, q, spans, sh, **kw) -> None:
    for li, got in enumerate(run(pool, q, spans, sh, **kw)):
        want = reference(pool, li, q, spans, sh, kw.get("window", 0))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_mixed_decode_and_prefill_with_shared_prefix():
    sh, rng = AttnShape(heads=6, kv_heads=2, head_dim=8, block_size=4), np.random.default_rng(0)
    shapes = [(0, 1), (37, 1), (5, 1), (0, 19), (12, 9), (12, 1), (3, 2), (60, 1)]
    share = [0, 0, 0, 0, 3, 3, 0, 0]  # seq 4 shares seq 3's first 3 blocks, seq 5 seq 4's
    pool = make_pool(sh, 80, rng)
    spans = spans_of(shapes, sh.block_size, rng.permutation(80), share)
    assert np.array_equal(spans[5].table[:3], spans[3].table[:3])
    poison_unwritten(pool, spans, sh.block_size)
    q = rng.standard_normal((sum(n for _, n in shapes), sh.heads, sh.head_dim))
    check(pool, q, spans, sh)
    check(pool, q, spans, sh, call_cost=0.0)   # every item its own group
    check(pool, q, spans, sh, call_cost=1e12)  # one group, all padded to the longest


def test_grouping_never_pads_decode_rows_to_a_prefill_chunk():
    sh = AttnShape(heads=14, kv_heads=2, head_dim=64, block_size=16)
    perm = np.arange(1000)
    decodes = spans_of([(100, 1)] * 8 + [(2000, 1)] * 8, 16, perm)
    plan = plan_attention(decodes, sh)
    assert sorted(g.rows.shape[0] for g in plan.groups) == [8, 8]  # two length classes, no 16x padding
    same = plan_attention(spans_of([(100 + i, 1) for i in range(32)], 16, perm), sh)
    assert len(same.groups) == 1  # similar lengths share one call
    mixed = plan_attention(spans_of([(300, 1), (0, 128), (50, 1)], 16, perm), sh)
    assert sorted(g.rows.shape[1] for g in mixed.groups) == [1, 128]


def test_long_chunk_tiny_tiles_equal_untiled():
    sh, rng = AttnShape(heads=4, kv_heads=1, head_dim=8, block_size=4), np.random.default_rng(1)
    spans = spans_of([(150, 170), (310, 1)], sh.block_size, rng.permutation(200))
    pool = make_pool(sh, 200, rng)
    poison_unwritten(pool, spans, sh.block_size)
    q = rng.standard_normal((171, sh.heads, sh.head_dim))
    tiny = plan_attention(spans, sh, q_tile=7, score_budget=1, kv_budget=1)
    assert all(g.tile_blocks == 1 for g in tiny.groups) and len(tiny.groups) > 1
    whole = plan_attention(spans, sh, q_tile=10_000, score_budget=1 << 40, kv_budget=1 << 40, call_cost=0.0)
    assert [g.rows.shape[1] for g in whole.groups] == [1, 170] and all(g.tile_blocks == g.table.shape[1]
                                                                     for g in whole.groups)
    for li in range(LAYERS):
        a = paged_attention(np, pool, li, q, tiny, np.float64)
        b = paged_attention(np, pool, li, q, whole, np.float64)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(a, reference(pool, li, q, spans, sh), rtol=1e-12, atol=1e-12)


def test_default_tiles_bound_memory_at_long_context():
    sh = AttnShape(heads=14, kv_heads=2, head_dim=64, block_size=16)
    spans = spans_of([(7680, 512)] + [(8000, 1)] * 32, 16, np.arange(20000))
    for g in plan_attention(spans, sh).groups:
        s, q = g.rows.shape
        assert g.tile_blocks == 1 or s * sh.heads * q * g.tile_blocks * 16 <= (1 << 20)
        assert g.tile_blocks == 1 or s * sh.kv_heads * sh.head_dim * g.tile_blocks * 16 <= (1 << 20)


def test_float32_compute_from_a_float16_pool():
    sh, rng = AttnShape(heads=4, kv_heads=2, head_dim=8, block_size=4), np.random.default_rng(2)
    spans = spans_of([(9, 3), (0, 1)], sh.block_size, rng.permutation(10))
    pool = make_pool(sh, 10, rng).astype(np.float16)
    q = rng.standard_normal((4, sh.heads, sh.head_dim)).astype(np.float32)
    got = paged_attention(np, pool, 1, q, plan_attention(spans, sh), np.float32)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference(pool.astype(np.float64), 1, q.astype(np.float64), spans, sh),
                               rtol=1e-5, atol=1e-5)


def test_sliding_window_reads_only_its_blocks():
    """A window of 6 over blocks of 4: decode rows, chunks starting mid-block and a chunk longer
    than the window, sequences sharing a prefix; every block that left the windows holds NaN."""
    sh, rng = AttnShape(heads=6, kv_heads=2, head_dim=8, block_size=4), np.random.default_rng(3)
    shapes = [(0, 1), (37, 1), (5, 1), (0, 19), (12, 9), (12, 1), (3, 2), (60, 1), (21, 30)]
    share = [0, 0, 0, 0, 3, 3, 0, 0, 0]
    pool = make_pool(sh, 120, rng)
    spans = spans_of(shapes, sh.block_size, rng.permutation(120), share)
    poison_unwritten(pool, spans, sh.block_size)
    poison_left_window(pool, spans, sh.block_size, 6)
    assert np.isnan(pool).any()
    q = rng.standard_normal((sum(n for _, n in shapes), sh.heads, sh.head_dim))
    check(pool, q, spans, sh, window=6)
    check(pool, q, spans, sh, window=6, call_cost=0.0)
    check(pool, q, spans, sh, window=6, call_cost=1e12, q_tile=5, score_budget=1, kv_budget=1)


def test_soft_capped_scores():
    sh, rng = AttnShape(heads=4, kv_heads=2, head_dim=8, block_size=4, softcap=1.5), np.random.default_rng(4)
    spans = spans_of([(9, 3), (0, 7), (30, 1)], sh.block_size, rng.permutation(40))
    pool = make_pool(sh, 40, rng)
    q = rng.standard_normal((11, sh.heads, sh.head_dim)) * 4  # scores well past the cap
    check(pool, q, spans, sh)
    check(pool, q, spans, sh, window=5)
    uncapped = run(pool, q, spans, AttnShape(heads=4, kv_heads=2, head_dim=8, block_size=4))[0]
    assert np.abs(run(pool, q, spans, sh)[0] - uncapped).max() > 1e-2, "the cap must change these scores"


@st.composite
def batches(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    kvh, grp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    sh = AttnShape(heads=kvh * grp, kv_heads=kvh, head_dim=4, block_size=bs,
                   softcap=draw(st.sampled_from([0.0, 0.0, 2.5])))
    shapes = draw(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([1, 1, 2, 5, 17, 33])),
                           min_size=1, max_size=6))
    share = [0]
    for (start, n), (pstart, pn) in zip(shapes[1:], shapes):
        share.append(draw(st.integers(0, min(start, pstart + pn) // bs)))
    knobs = dict(q_tile=draw(st.sampled_from([1, 4, 16, 128])),
                 score_budget=draw(st.sampled_from([1, 64, 1 << 20])),
                 kv_budget=draw(st.sampled_from([1, 64, 1 << 20])),
                 call_cost=draw(st.sampled_from([0.0, 400.0, 1e12])),
                 window=draw(st.sampled_from([0, 0, 1, 3, 8, 20])))
    return sh, shapes, share, knobs, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_batched_equals_per_sequence(batch):
    sh, shapes, share, knobs, seed = batch
    rng = np.random.default_rng(seed)
    blocks = sum(-(-(s + n) // sh.block_size) for s, n in shapes)
    pool = make_pool(sh, blocks, rng)
    spans = spans_of(shapes, sh.block_size, rng.permutation(blocks), share)
    poison_unwritten(pool, spans, sh.block_size)
    if knobs["window"]:
        poison_left_window(pool, spans, sh.block_size, knobs["window"])
    q = rng.standard_normal((sum(n for _, n in shapes), sh.heads, sh.head_dim)) * 3
    check(pool, q, spans, sh, **knobs)
