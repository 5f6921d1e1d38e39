"""The q/k/v projection's epilogue: bias, per-head RMSNorm of q and k (Qwen3), RoPE, the
attention scale on q, and K and V written into the paged pool at each token's slot.

Why fused: the reference does this in a dozen array operations a layer plus two scatters into
the pool; here one program per (token, head) reads its head's columns of the fused GEMM's output
once. q comes out in float32, scaled by head_dim**-0.5 (what attention multiplies); k and v are
rounded to the pool's dtype as they are stored, exactly as the reference stores them.

RoPE's cos and sin come from tables indexed by absolute position (`rope_tables`), computed in
float64 and rounded once, as the reference computes its angles, so a token's rotation does not
depend on how its sequence was chunked. Rotate-half: [x1 cos - x2 sin, x2 cos + x1 sin].
"""
from __future__ import annotations

import triton
import triton.language as tl

from kvrt.workers.model.kernels.plan import next_pow2


@triton.jit(do_not_specialize=["stride_qkv", "layer", "num_layers", "block_size"])
def _rope_kv_kernel(qkv_ptr, bias_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, pool_ptr, q_ptr,
                    stride_qkv, layer, num_layers, block_size, eps, scale,
                    H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HALF_BLOCK: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)            # q head j < H, else k head j - H (and its v head)
    half = HD // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    col = j * HD                    # a k head's columns follow the q heads', so both start at j * HD
    row = qkv_ptr + t * stride_qkv
    x1 = tl.load(row + col + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + col + half + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x1 += tl.load(bias_ptr + col + offs, mask=mask, other=0.0).to(tl.float32)
        x2 += tl.load(bias_ptr + col + half + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        r = tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD + eps)
        if j < H:
            w1 = tl.load(qn_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(qn_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(kn_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(kn_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = x1 / r * w1
        x2 = x2 / r * w2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * half + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos * half + offs, mask=mask, other=0.0)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if j < H:
        qrow = q_ptr + (t * H + j) * HD
        tl.store(qrow + offs, y1 * scale, mask=mask)
        tl.store(qrow + half + offs, y2 * scale, mask=mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            h = j - H
            blk = slot // block_size
            off = slot % block_size
            kaddr = pool_ptr + ((((blk * num_layers + layer) * 2) * block_size + off) * KVH + h) * HD
            vaddr = kaddr + block_size * KVH * HD
            dt = pool_ptr.dtype.element_ty
            tl.store(kaddr + offs, y1.to(dt), mask=mask)
            tl.store(kaddr + half + offs, y2.to(dt), mask=mask)
            vcol = (j + KVH) * HD
            v1 = tl.load(row + vcol + offs, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(row + vcol + half + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                v1 += tl.load(bias_ptr + vcol + offs, mask=mask, other=0.0).to(tl.float32)
                v2 += tl.load(bias_ptr + vcol + half + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(vaddr + offs, v1.to(dt), mask=mask)
            tl.store(vaddr + half + offs, v2.to(dt), mask=mask)


def rope_write_kv(qkv, bias, q_norm, k_norm, eps: float, cos, sin, positions, slots, pool, layer: int,
                  scale: float, q_out, heads: int, kv_heads: int, head_dim: int) -> None:
    """From qkv [T, (heads + 2 kv_heads) * head_dim] (the fused GEMM's output): q_out [T, heads,
    head_dim] (float32, rotated and scaled), and K and V of each token written into `pool` at
    slots[t] (block * block_size + offset; -1: not written). `bias` [(heads + 2 kv_heads) *
    head_dim], `q_norm` and `k_norm` [head_dim] may be None; cos and sin [positions, head_dim / 2]."""
    t = qkv.shape[0]
    if t == 0:
        return
    _rope_kv_kernel[(t, heads + kv_heads)](
        qkv, bias if bias is not None else qkv, q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos, cos, sin, positions, slots, pool, q_out,
        qkv.stride(0), layer, pool.shape[1], pool.shape[3], float(eps), float(scale),
        H=heads, KVH=kv_heads, HD=head_dim, HALF_BLOCK=next_pow2(head_dim // 2, 2),
        HAS_BIAS=bias is not None, HAS_QK_NORM=q_norm is not None, num_warps=1)
