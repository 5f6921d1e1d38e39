"""SiLU of the gate times the up projection, from the fused gate/up GEMM's output.

Why fused: silu(g) * u is four elementwise launches over [tokens, mlp] otherwise; here one read
of the GEMM's output and one write of the down projection's input, rounded once to the dtype
that GEMM multiplies in (the reference computes it in float32 and rounds it there too).
"""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024  # columns a program handles


@triton.jit(do_not_specialize=["stride_gu", "stride_out"])
def _silu_mul_kernel(gu_ptr, out_ptr, m, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < m
    g = tl.load(gu_ptr + row * stride_gu + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + m + col, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + col, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up, out) -> None:
    """out = silu(gate_up[:, :m]) * gate_up[:, m:] for gate_up [rows, 2m], out [rows, m]."""
    rows, m = out.shape
    if rows == 0:
        return
    _silu_mul_kernel[(rows, triton.cdiv(m, BLOCK))](gate_up, out, m, gate_up.stride(0), out.stride(0), BLOCK=BLOCK)
