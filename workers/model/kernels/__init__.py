"""Triton kernels of the torch backend (workers/model/torch_backend.py), one fused operation per
file: RMSNorm with the residual add (norm.py), the q/k/v projection's epilogue with RoPE and the
K/V write into the paged pool (rope_kv.py), SiLU times the up projection (silu_mul.py), paged
decode attention split over the context (decode_attention.py) and paged attention of prefill
chunks over their cached prefixes (prefill_attention.py).

Why fused kernels: a decode step of a small model is a few hundred tiny operations, and on a GPU
each one launched from Python costs more than its own work; these few kernels replace the
elementwise chains between the GEMMs, and attention reads K/V through the block table in place
(no gathered copy), so a step is about seven launches a layer, all of which a CUDA graph can
capture (workers/model/graphs.py).

Conventions every kernel keeps, so one reading covers them all:
- arithmetic in float32 whatever the storage dtype (loads are converted first, stores rounded
  once), matching the reference model's float32 residual stream, norms, RoPE and softmax;
- the pool is `[blocks, layers, 2, block_size, kv_heads, head_dim]` (ipc/layout.py), addressed
  with 64-bit offsets (a pool passes 2**31 elements at a few GB);
- a slot of -1 writes nothing and a context length of 0 attends to nothing (output 0): that is
  how a CUDA graph's padding rows stay harmless;
- integer arguments that change from step to step are not specialised on (Triton would compile
  a variant for a value of 1 or a multiple of 16), so serving meets no new compile after the
  worker's warm-up.

Triton's interpreter (TRITON_INTERPRET=1) runs every kernel on a CPU, which is how the tests
check them against the float64 reference without a GPU (docs/development.md, the kernels lane).
"""
