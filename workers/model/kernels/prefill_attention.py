"""Paged attention of a step's prefill chunks (and any decode rows beside them) over their cached
prefixes: causal, varlen, reading K/V from the pool through each sequence's block table.

Why: a chunk of a prompt whose prefix is cached (a prefix-cache hit, or an earlier chunk) must
attend to keys that exist only in the pool, so the kernel reads the pool directly, as the decode
kernel does, instead of gathering each sequence's context into a dense copy. The step's K/V are
written into the pool first (rope_kv.py), so the chunk's own keys come the same way.

One program per (query tile, query head): a tile is up to BLOCK_M consecutive query rows of one
sequence (the host cuts the batch into tiles, `tiles`), and it walks the keys from position 0 to
its last row's position with an online softmax, masking keys after each row's own position.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kvrt.workers.model.kernels.paged_tile import load_kv_tile, softmax_step
from kvrt.workers.model.kernels.plan import next_pow2

BLOCK_N = 32


@triton.jit(do_not_specialize=["layer", "num_layers", "block_size", "table_stride", "out_stride"])
def _prefill_kernel(q_ptr, pool_ptr, table_ptr, tile_seq_ptr, tile_row_ptr, row0_ptr, start_ptr, n_ptr, out_ptr,
                    layer, num_layers, block_size, table_stride, out_stride,
                    H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, G: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    sq = tl.load(tile_seq_ptr + i).to(tl.int64)
    r = tl.load(tile_row_ptr + i)
    row0 = tl.load(row0_ptr + sq).to(tl.int64)
    start = tl.load(start_ptr + sq)
    n = tl.load(n_ptr + sq)
    rows = r + tl.arange(0, BLOCK_M)
    rm = rows < n
    qpos = start + rows
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    qrow = (row0 + rows) * H + h
    q = tl.load(q_ptr + qrow[:, None] * HD + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    kh = h // G
    kv_end = start + tl.minimum(r + BLOCK_M, n)  # keys up to the tile's last row's position
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in range(0, kv_end, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        km = keys < kv_end
        k, v = load_kv_tile(pool_ptr, table_ptr + sq * table_stride, keys, km, d, dm, layer, num_layers, block_size,
                            kh, KVH, HD)
        visible = km[None, :] & (keys[None, :] <= qpos[:, None])
        m_i, l_i, acc = softmax_step(q, k, v, visible, m_i, l_i, acc, F32_DOT)
    res = acc / l_i[:, None]
    out_rows = row0 + rows
    tl.store(out_ptr + out_rows[:, None] * out_stride + h * HD + d[None, :], res.to(out_ptr.dtype.element_ty),
             mask=rm[:, None] & dm[None, :])


def paged_prefill(q, pool, layer: int, tables, tile_seq, tile_row, row0, starts, lens, out, block_m: int,
                  heads: int, kv_heads: int, head_dim: int) -> None:
    """out [T, heads * head_dim] = causal attention of q [T, heads, head_dim] (float32, scaled;
    sequence i's rows are row0[i] .. row0[i] + lens[i] - 1 at positions starts[i]..) over each
    sequence's keys at positions 0..its own in layer `layer` of `pool`, through tables [S, width];
    tile_seq and tile_row from `plan.tiles(lens, block_m)` (device int32 arrays, as are the rest)."""
    n_tiles = tile_seq.shape[0]
    if n_tiles == 0:
        return
    _prefill_kernel[(n_tiles, heads)](
        q, pool, tables, tile_seq, tile_row, row0, starts, lens, out, layer, pool.shape[1], pool.shape[3],
        tables.stride(0), out.stride(0), H=heads, KVH=kv_heads, HD=head_dim, G=heads // kv_heads,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=next_pow2(head_dim), F32_DOT=pool.element_size() == 4,
        num_warps=4)
