"""RMSNorm, optionally with the residual add before it, in one pass over a row.

Why fused: between two GEMMs a layer adds the sublayer's output to the residual stream and
normalises the sum; as separate operations that is five or six launches and three trips through
memory, here one. The residual stream stays float32 and is updated in place; the normalised row
is written in the dtype the next GEMM multiplies in (rounded once, as the reference rounds it).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kvrt.workers.model.kernels.plan import next_pow2


@triton.jit(do_not_specialize=["stride_x", "stride_delta", "stride_out"])
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, d, eps, stride_x, stride_delta, stride_out,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    mean = tl.sum(x * x, axis=0) / d
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x / tl.sqrt(mean + eps) * w
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x, w, eps: float, out, delta=None) -> None:
    """out[i] = RMSNorm(x[i] (+= delta[i])) * w for every row i of x [rows, d] (float32; updated
    in place when `delta` is given); `out` [rows, d] in any float dtype."""
    rows, d = x.shape
    if rows == 0:
        return
    _rms_norm_kernel[(rows,)](x, delta if delta is not None else x, w, out, d, float(eps), x.stride(0),
                              delta.stride(0) if delta is not None else 0, out.stride(0),
                              HAS_DELTA=delta is not None, BLOCK=next_pow2(d), num_warps=4 if d <= 2048 else 8)
