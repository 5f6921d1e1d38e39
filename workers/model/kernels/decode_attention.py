"""Paged decode attention: one query token per sequence over its context, read from the pool
through its block table in place, split over the context (flash-decoding) and then combined.

Why split: a decode batch of a few sequences gives a GPU a few programs' worth of parallelism
if each sequence is one program, and a long context is then one long loop. Each (sequence, KV
head) is cut into `num_splits` stretches of its context; a program attends its stretch for every
query head of its group (GQA: K and V are read once for the whole group, the group padded to a
tile of 16 rows for tl.dot) with an online softmax, and leaves its running max, sum and
unnormalised output; a second kernel weighs the stretches together. The stretch length is
worked out in the kernel from the sequence's context length, and the split count is a launch
argument, so the launch a CUDA graph captures serves any context up to the table's width.

Dot products multiply in the pool's dtype (a float16 pool: tensor cores, float32 accumulation;
a float32 pool: full float32), softmax and accumulation are float32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kvrt.workers.model.kernels.paged_tile import load_kv_tile, softmax_step
from kvrt.workers.model.kernels.plan import MAX_SPLITS, next_pow2

BLOCK_N = 32       # keys per inner iteration
MIN_SPLIT = 64     # a stretch holds at least this many keys (shorter ones cost more to combine than they save)


@triton.jit(do_not_specialize=["layer", "num_layers", "block_size", "table_stride", "num_splits"])
def _decode_split_kernel(q_ptr, pool_ptr, table_ptr, ctx_ptr, mid_o_ptr, mid_ml_ptr,
                         layer, num_layers, block_size, table_stride, num_splits,
                         H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, G: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         MIN_SPLIT: tl.constexpr, F32_DOT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    length = tl.maximum(tl.cdiv(ctx, num_splits), MIN_SPLIT)
    length = tl.cdiv(length, BLOCK_N) * BLOCK_N
    start = s * length
    end = tl.minimum(start + length, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < HD
    heads = kh * G + g
    q = tl.load(q_ptr + (b * H + heads)[:, None] * HD + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        k, v = load_kv_tile(pool_ptr, table_ptr + b * table_stride, n, nm, d, dm, layer, num_layers, block_size,
                            kh, KVH, HD)
        m_i, l_i, acc = softmax_step(q, k, v, nm[None, :], m_i, l_i, acc, F32_DOT)
    idx = (b * H + heads) * num_splits + s
    tl.store(mid_o_ptr + idx[:, None] * HD + d[None, :], acc, mask=gm[:, None] & dm[None, :])
    tl.store(mid_ml_ptr + idx * 2, m_i, mask=gm)
    tl.store(mid_ml_ptr + idx * 2 + 1, l_i, mask=gm)


@triton.jit(do_not_specialize=["num_splits", "out_stride"])
def _decode_combine_kernel(mid_o_ptr, mid_ml_ptr, out_ptr, num_splits, out_stride,
                           H: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = s < num_splits
    dm = d < HD
    idx = (b * H + h) * num_splits + s
    m = tl.load(mid_ml_ptr + idx * 2, mask=sm, other=float("-inf"))
    l = tl.load(mid_ml_ptr + idx * 2 + 1, mask=sm, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp(m - top), 0.0)  # an empty stretch (l = 0) weighs nothing
    total = tl.sum(l * w, axis=0)
    o = tl.load(mid_o_ptr + idx[:, None] * HD + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    acc = tl.sum(o * w[:, None], axis=0)
    res = tl.where(total > 0, acc / total, 0.0)  # context 0 (a graph's padding row): 0
    tl.store(out_ptr + b * out_stride + h * HD + d, res.to(out_ptr.dtype.element_ty), mask=dm)


def paged_decode(q, pool, layer: int, tables, context_lens, out, mid_o, mid_ml, num_splits: int,
                 heads: int, kv_heads: int, head_dim: int) -> None:
    """out [B, heads * head_dim] = attention of q [B, heads, head_dim] (float32, scaled) over
    the first context_lens[b] positions of each row's sequence in layer `layer` of `pool`,
    through tables [B, width] (block ids, int32). mid_o and mid_ml are scratch of
    `plan.scratch_shapes(B, heads, head_dim, num_splits)`."""
    batch = q.shape[0]
    if batch == 0:
        return
    group = heads // kv_heads
    block_d = next_pow2(head_dim)
    f32 = pool.element_size() == 4
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, pool, tables, context_lens, mid_o, mid_ml, layer, pool.shape[1], pool.shape[3], tables.stride(0),
        num_splits, H=heads, KVH=kv_heads, HD=head_dim, G=group, BLOCK_G=next_pow2(group), BLOCK_D=block_d,
        BLOCK_N=BLOCK_N, MIN_SPLIT=MIN_SPLIT, F32_DOT=f32, num_warps=4)
    _decode_combine_kernel[(batch, heads)](mid_o, mid_ml, out, num_splits, out.stride(0), H=heads, HD=head_dim,
                                           BLOCK_D=block_d, BLOCK_S=next_pow2(MAX_SPLITS, 1), num_warps=1)
