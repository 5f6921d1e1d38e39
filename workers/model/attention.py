"""Causal attention of a whole step batch over the paged KV pool, in a few batched calls.

A step mixes decode rows (one query each, contexts of any length) with prefill chunks (many
queries over the cached context plus themselves). Attending each sequence alone costs a Python
round of small array calls per sequence per layer (hundreds of kernel launches a step on a GPU)
and a copy of its whole context out of the pool. Instead, once per step, `plan_attention` cuts
the batch into *items* (a decode row, or a tile of at most `q_tile` rows of a prefill chunk) and
packs items of similar shape into *groups*: each group is padded to its largest item (query rows
and context blocks) and its block tables become one index array. Per layer, `paged_attention`
then runs each group as batched matmuls over key tiles of a bounded size: each tile's K and V
come out of the pool in one fancy index, and an online softmax (running max and running sum)
folds the tiles together, so neither the gathered K/V nor the score matrix ever holds a long
prompt's whole context at once. Padded keys (past a sequence's context, or past a query's own
position) are masked; padded query rows repeat a real row and are dropped at the end.

A sliding-window layer (its keys at positions > pos - W for a query at pos) gets a plan of its
own (`window`): each item's block table starts at the block holding the first key its first
query row sees, so the blocks before it, which have left the window, are never read at all
(not read and masked: a block that left every window may be freed and hold anything, NaN
included, and a masked NaN still poisons a sum; in a model of layer groups a sliding group's
table names no page there at all, -1, since its pages were given back: runtime/cache/groups.py).
Within the item's blocks, keys before a row's window are masked like keys after its position.

Which items share a group is a cost model: merging saves one round of calls and pays for the
padding it adds, so decode rows of similar context lengths share one group while a decode row is
never padded to a prefill chunk's row count. Only summation order differs from attending each
sequence alone over its gathered context (~1e-15 relative in float64).

The same code runs on numpy or CuPy (`xp`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

Q_TILE = 128            # query rows of a prefill chunk attended together
SCORE_BUDGET = 1 << 20  # elements of one key tile's score matrix (bounds memory at long context)
KV_BUDGET = 1 << 17     # elements of one key tile's gathered K (and as many of V): cache-sized
# the cost model of grouping, in units of one query row attending one block of keys: the gather
# of a block (paid once per sequence, whatever its query rows) and the fixed cost of a group's
# round of array calls per layer
GATHER_COST = 2.0
CALL_COST = 400.0


@dataclass(frozen=True)
class Span:
    """One sequence of the batch: its query rows [row0, row0 + n) of the batch at positions
    start.., and its block table (host ints) covering positions 0..start + n - 1."""

    row0: int
    n: int
    start: int
    table: np.ndarray


@dataclass(frozen=True)
class AttnShape:
    """What the attention needs of the model: query heads share KV heads in groups of
    heads // kv_heads (GQA)."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    softcap: float = 0.0  # scores become softcap * tanh(scores / softcap) (Gemma 2); 0: as they are


@dataclass
class _Group:
    """Items attended in one batched call: S items padded to Q query rows and B context blocks."""

    table: Any          # xp int [S, B]: block ids (padding repeats a valid block, masked)
    rows: Any           # xp int [S, Q]: batch row of each query slot (padding repeats the last row)
    qpos: Any           # xp int [S, 1, 1, Q, 1]: position of each query slot, to mask keys after it
    min_pos: int        # the smallest query position: key tiles wholly at or before it need no mask
    ctx: Any            # xp int [S, 1]: context length of each item (V past it is unwritten, zeroed)
    min_ctx: int
    keep: Any           # xp int: flat [S*Q] slots holding real rows, or None when all are real
    dst: Any            # xp int: the batch rows of the kept slots
    tile_blocks: int    # key blocks per tile
    window: int = 0     # a sliding window's size; 0: none
    kbase: Any = None   # with a window, xp int [S, 1]: the position of each item's first block's first key
    klo: Any = None     # with a window, xp int [S, 1]: each item's first key in its first row's window


@dataclass
class AttentionPlan:
    """A step batch cut into groups; built once per step over one layer group's block tables
    (ipc/layout.py LayerGroups), used by every layer of that group (they share its window)."""

    groups: list[_Group]
    num_rows: int
    shape: AttnShape
    window: int = 0


def _cost(s: int, q: int, b: int, call_cost: float) -> float:
    """What attending s items padded to q rows and b blocks costs (module constants' units)."""
    return call_cost + s * b * (GATHER_COST + q)


Item = tuple[int, int, int, np.ndarray, int]  # first batch row, rows, first position, block table, first block


def _items(spans: Sequence[Span], bs: int, q_tile: int, window: int) -> list[Item]:
    """Each item: a span's rows cut into tiles of at most q_tile, each with only the blocks its
    rows can see: up to its last row's, and with a window from its first row's first key's."""
    out = []
    for sp in spans:
        for a in range(0, sp.n, q_tile):
            rows = min(q_tile, sp.n - a)
            nblk = -(-(sp.start + a + rows) // bs)
            first = max(0, sp.start + a - window + 1) // bs if window else 0
            out.append((sp.row0 + a, rows, sp.start + a, sp.table[first:nblk], first))
    return out


def plan_attention(spans: Sequence[Span], shape: AttnShape, xp: Any = np, q_tile: int = Q_TILE,
                   score_budget: int = SCORE_BUDGET, kv_budget: int = KV_BUDGET,
                   call_cost: float = CALL_COST, window: int = 0) -> AttentionPlan:
    """Group the batch's items (module docstring); q_tile and the budgets bound the rows, keys
    and scores one call holds, call_cost trades padding for fewer calls (0: never pad, huge:
    one group); `window` (> 0) plans a sliding-window layer's attention."""
    bs = shape.block_size
    items = sorted(_items(spans, bs, q_tile, window), key=lambda it: (it[1], len(it[3])))
    packs: list[list[Item]] = []
    q = b = 0  # the last pack's padded rows and blocks
    for it in items:
        n, nb = it[1], len(it[3])
        if packs and (_cost(len(packs[-1]) + 1, max(q, n), max(b, nb), call_cost)
                      <= _cost(len(packs[-1]), q, b, call_cost) + _cost(1, n, nb, call_cost)):
            packs[-1].append(it)
            q, b = max(q, n), max(b, nb)
        else:
            packs.append([it])
            q, b = n, nb
    groups = [_group(p, shape, xp, score_budget, kv_budget, window) for p in packs]
    return AttentionPlan(groups, sum(sp.n for sp in spans), shape, window)


def _group(items: list[Item], shape: AttnShape, xp: Any, score_budget: int, kv_budget: int, window: int) -> _Group:
    s = len(items)
    q = max(it[1] for it in items)
    b = max(len(it[3]) for it in items)
    table = np.empty((s, b), np.int64)
    rows = np.empty((s, q), np.int64)
    qpos = np.empty((s, q), np.int64)
    for i, (row0, n, start, tbl, _) in enumerate(items):
        table[i, :len(tbl)] = tbl
        table[i, len(tbl):] = tbl[0]
        r = np.minimum(np.arange(q), n - 1)
        rows[i], qpos[i] = row0 + r, start + r
    real = (np.arange(q)[None, :] < np.array([it[1] for it in items])[:, None]).ravel()
    keep = None if real.all() else xp.asarray(np.flatnonzero(real))
    per_block = max(s * shape.heads * q * shape.block_size / score_budget,
                    s * shape.kv_heads * shape.head_dim * shape.block_size / kv_budget)
    tile = int(max(1, min(b, 1 / per_block if per_block else b)))
    ctx = np.array([it[2] + it[1] for it in items])
    kbase = klo = None
    if window:
        kbase = xp.asarray(np.array([it[4] * shape.block_size for it in items])[:, None])
        klo = xp.asarray(np.array([max(0, it[2] - window + 1) for it in items])[:, None])
    return _Group(xp.asarray(table), xp.asarray(rows), xp.asarray(qpos.reshape(s, 1, 1, q, 1)),
                  int(qpos.min()), xp.asarray(ctx[:, None]), int(ctx.min()), keep, xp.asarray(rows.ravel()[real]), tile,
                  window, kbase, klo)


def paged_attention(xp: Any, pool: Any, layer: int, q: Any, plan: AttentionPlan, compute_dtype: Any,
                    mark: Callable[[], None] | None = None, load: Callable[[Any], Any] | None = None) -> Any:
    """Causal attention of the batch's queries q [N, heads, head_dim] (scaled) over the keys and
    values of layer slot `layer` of pool [blocks, layers, 2, block_size, kv_heads, head_dim], read
    in compute_dtype (by `load`, from the pool's elements: an FP8 pool's bytes are decoded by it,
    workers/model/kv_format.py), within the plan's window; returns [N, heads * head_dim]. `mark`
    is called after each key tile (the worker's progress: a long prompt's attention is many
    tiles)."""
    sh = plan.shape
    out = xp.empty((plan.num_rows, sh.heads * sh.head_dim), dtype=q.dtype)
    kpool, vpool = pool[:, layer, 0], pool[:, layer, 1]
    if load is None:
        def load(a: Any) -> Any:
            return a.astype(compute_dtype, copy=False)
    for g in plan.groups:
        res = _attend_group(xp, kpool, vpool, q, g, sh, load, mark)
        out[g.dst] = res if g.keep is None else res[g.keep]
    return out


def _attend_group(xp: Any, kpool: Any, vpool: Any, q: Any, g: _Group, sh: AttnShape, load: Callable[[Any], Any],
                  mark: Callable[[], None] | None) -> Any:
    s, qn = g.rows.shape
    b = g.table.shape[1]
    kvh, grp, hd, bs = sh.kv_heads, sh.heads // sh.kv_heads, sh.head_dim, sh.block_size
    # [S, Q, H, hd] -> [S, kvh, grp*Q, hd]: each KV head's query heads and rows in one matrix
    qg = q[g.rows].reshape(s, qn, kvh, grp, hd).transpose(0, 2, 3, 1, 4).reshape(s, kvh, grp * qn, hd)
    m = l = acc = None
    for b0 in range(0, b, g.tile_blocks):
        tbl = g.table[:, b0:b0 + g.tile_blocks]
        t = tbl.shape[1] * bs
        k = load(kpool[tbl].reshape(s, t, kvh, hd))
        v = load(vpool[tbl].reshape(s, t, kvh, hd))
        sc = (qg @ k.transpose(0, 2, 3, 1)).reshape(s, kvh, grp, qn, t)
        if sh.softcap:
            sc = xp.tanh(sc / sh.softcap) * sh.softcap
        kpos = xp.arange(b0 * bs, b0 * bs + t)
        if g.window:  # each item's keys from its own first block on; V outside every row's window zeroed
            kpos = g.kbase + kpos  # [S, T]
            kq = kpos[:, None, None, None, :]
            sc = xp.where((kq <= g.qpos) & (kq > g.qpos - g.window), sc, -xp.inf)
            v = xp.where(((kpos >= g.klo) & (kpos < g.ctx))[:, :, None, None], v, 0)
        else:
            if b0 * bs + t - 1 > g.min_pos:  # some key of the tile lies after some query
                sc = xp.where(kpos <= g.qpos, sc, -xp.inf)
            if b0 * bs + t > g.min_ctx:  # unwritten slots (any bits, NaN too) must not reach 0 * v
                v = xp.where((kpos < g.ctx)[:, :, None, None], v, 0)
        mt = sc.max(axis=-1)
        if m is None:
            m_new = mt
        else:
            m_new = xp.maximum(m, mt)
        # with a window a row may see no key of a tile, the first included (its keys all -inf):
        # shifting by 0 then keeps exp() at 0 where -inf - -inf would be NaN
        shift = xp.where(m_new == -xp.inf, 0, m_new) if g.window else m_new
        sc -= shift[..., None]
        p = xp.exp(sc, out=sc)
        pv = p.reshape(s, kvh, grp * qn, t) @ v.transpose(0, 2, 1, 3)
        if m is None:
            l, acc = p.sum(axis=-1), pv
        else:
            alpha = xp.exp(m - shift)
            l = l * alpha + p.sum(axis=-1)
            acc = acc * alpha.reshape(s, kvh, grp * qn, 1) + pv
        m = m_new
        if mark is not None:
            mark()
    o = acc / l.reshape(s, kvh, grp * qn, 1)
    return o.reshape(s, kvh, grp, qn, hd).transpose(0, 3, 1, 2, 4).reshape(s * qn, sh.heads * hd)
