"""The two pieces every paged attention kernel here repeats per tile of keys: reading the tile's K
and V from the pool through a sequence's block table, and folding it into an online softmax.

Why helpers of their own: the decode and prefill kernels differ in what a program owns (a stretch
of one sequence's context for a group of query heads; a tile of query rows for one head) and in
their masks, not in how a tile of keys is found in the pool or weighed; Triton inlines these.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(pool_ptr, table_row_ptr, keys, km, d, dm, layer, num_layers, block_size, kh,
                 KVH: tl.constexpr, HD: tl.constexpr):
    """K and V [len(keys), BLOCK_D] of KV head `kh` at positions `keys` (masked by `km`, and the
    head dimension by `dm`) in layer `layer`, through the block table row at `table_row_ptr`."""
    blk = tl.load(table_row_ptr + keys // block_size, mask=km, other=0).to(tl.int64)
    kaddr = ((((blk * num_layers + layer) * 2) * block_size + keys % block_size) * KVH + kh) * HD
    kvm = km[:, None] & dm[None, :]
    k = tl.load(pool_ptr + kaddr[:, None] + d[None, :], mask=kvm, other=0.0)
    v = tl.load(pool_ptr + kaddr[:, None] + block_size * KVH * HD + d[None, :], mask=kvm, other=0.0)
    return k, v


@triton.jit
def softmax_step(q, k, v, visible, m_i, l_i, acc, F32_DOT: tl.constexpr):
    """The running max, sum and unnormalised output after the keys `k`, `v` (where `visible`);
    dot products in the pool's dtype unless F32_DOT, softmax and accumulation in float32."""
    if F32_DOT:
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q.to(k.dtype), tl.trans(k))
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if F32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv
