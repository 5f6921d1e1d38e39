"""The torch backend's op set: the few operations a layer is made of between its GEMMs, in two
implementations with one signature each.

- `TritonOps`: the fused kernels of workers/model/kernels/ (a GPU, or a CPU under Triton's
  interpreter in the tests);
- `TorchOps`: the same operations in plain torch (a CPU without Triton: the tests' and a
  CPU node's way to run the torch backend; also what a GPU falls back to without Triton).

The layer loop (workers/model/torch_backend.py) calls only these and torch's GEMMs, so the model
is written once and the backend is how its ops run. Both keep the kernels' conventions
(workers/model/kernels/__init__.py): float32 arithmetic, a slot of -1 writes nothing, a context
of 0 attends to nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DecodeMeta:
    """A decode batch's attention inputs: one query row per sequence. `tables` [B, width] and
    `context` [B] are int32 on the device; `mid_o` and `mid_ml` the split kernel's scratch."""

    tables: Any
    context: Any
    splits: int
    mid_o: Any
    mid_ml: Any


@dataclass
class PrefillMeta:
    """A mixed batch's attention inputs: sequence i's rows row0[i].. at positions starts[i]..
    (lens[i] rows), its blocks in tables[i]; the query tiles (kernels/prefill_attention.py)."""

    tables: Any
    row0: Any
    starts: Any
    lens: Any
    tile_seq: Any
    tile_row: Any
    block_m: int


class TritonOps:
    """The fused Triton kernels."""

    name = "triton"

    def __init__(self) -> None:
        from kvrt.workers.model.kernels import decode_attention, norm, prefill_attention, rope_kv, silu_mul

        self._norm, self._rope, self._silu = norm.rms_norm, rope_kv.rope_write_kv, silu_mul.silu_mul
        self._decode, self._prefill = decode_attention.paged_decode, prefill_attention.paged_prefill

    def rms_norm(self, x: Any, w: Any, eps: float, out: Any, delta: Any = None) -> None:
        self._norm(x, w, eps, out, delta)

    def silu_mul(self, gate_up: Any, out: Any) -> None:
        self._silu(gate_up, out)

    def rope_write_kv(self, qkv: Any, bias: Any, q_norm: Any, k_norm: Any, eps: float, cos: Any, sin: Any,
                      positions: Any, slots: Any, pool: Any, layer: int, scale: float, q_out: Any,
                      heads: int, kv_heads: int, head_dim: int) -> None:
        self._rope(qkv, bias, q_norm, k_norm, eps, cos, sin, positions, slots, pool, layer, scale, q_out,
                   heads, kv_heads, head_dim)

    def decode_attention(self, q: Any, pool: Any, layer: int, meta: DecodeMeta, out: Any, heads: int,
                         kv_heads: int, head_dim: int) -> None:
        self._decode(q, pool, layer, meta.tables, meta.context, out, meta.mid_o, meta.mid_ml, meta.splits,
                     heads, kv_heads, head_dim)

    def prefill_attention(self, q: Any, pool: Any, layer: int, meta: PrefillMeta, out: Any, heads: int,
                          kv_heads: int, head_dim: int) -> None:
        self._prefill(q, pool, layer, meta.tables, meta.tile_seq, meta.tile_row, meta.row0, meta.starts,
                      meta.lens, out, meta.block_m, heads, kv_heads, head_dim)


class TorchOps:
    """The same operations in plain torch, one sequence at a time where attention needs it."""

    name = "torch"

    def rms_norm(self, x: Any, w: Any, eps: float, out: Any, delta: Any = None) -> None:
        if delta is not None:
            x += delta.float()
        out.copy_(x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w)

    def silu_mul(self, gate_up: Any, out: Any) -> None:
        m = out.shape[1]
        g, u = gate_up[:, :m].float(), gate_up[:, m:].float()
        out.copy_(g / (1.0 + torch.exp(-g)) * u)

    def rope_write_kv(self, qkv: Any, bias: Any, q_norm: Any, k_norm: Any, eps: float, cos: Any, sin: Any,
                      positions: Any, slots: Any, pool: Any, layer: int, scale: float, q_out: Any,
                      heads: int, kv_heads: int, head_dim: int) -> None:
        t = qkv.shape[0]
        y = qkv.float()
        if bias is not None:
            y = y + bias
        q = y[:, :heads * head_dim].reshape(t, heads, head_dim)
        k = y[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(t, kv_heads, head_dim)
        v = y[:, (heads + kv_heads) * head_dim:].reshape(t, kv_heads, head_dim)
        if q_norm is not None:
            q = q / torch.sqrt((q * q).mean(dim=-1, keepdim=True) + eps) * q_norm
            k = k / torch.sqrt((k * k).mean(dim=-1, keepdim=True) + eps) * k_norm
        pos = positions.long()
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        half = head_dim // 2

        def rot(a: Any) -> Any:
            a1, a2 = a[..., :half], a[..., half:]
            return torch.cat([a1 * c - a2 * s, a2 * c + a1 * s], dim=-1)

        q_out.copy_(rot(q) * scale)
        keep = slots >= 0
        sl = slots[keep].long()
        bs = pool.shape[3]
        blk, off = sl // bs, sl % bs
        pool[blk, layer, 0, off] = rot(k)[keep].to(pool.dtype)
        pool[blk, layer, 1, off] = v[keep].to(pool.dtype)

    def _attend(self, q: Any, pool: Any, layer: int, table: Any, start: int, heads: int, kv_heads: int,
                head_dim: int) -> Any:
        """Causal attention of q [n, heads, head_dim] at positions start.. over the sequence's keys
        at positions 0..start + n - 1; [n, heads * head_dim] float32."""
        n = q.shape[0]
        ctx = start + n
        bs = pool.shape[3]
        blocks = table[:-(-ctx // bs)].long()
        k = pool[blocks, layer, 0].reshape(-1, kv_heads, head_dim)[:ctx].float()
        v = pool[blocks, layer, 1].reshape(-1, kv_heads, head_dim)[:ctx].float()
        g = heads // kv_heads
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scores = torch.einsum("nhd,khd->hnk", q.float(), k)
        visible = torch.arange(ctx, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hnk,khd->nhd", probs, v).reshape(n, heads * head_dim)

    def decode_attention(self, q: Any, pool: Any, layer: int, meta: DecodeMeta, out: Any, heads: int,
                         kv_heads: int, head_dim: int) -> None:
        for b, ctx in enumerate(meta.context.tolist()):
            if ctx == 0:
                out[b] = 0
            else:
                out[b] = self._attend(q[b:b + 1], pool, layer, meta.tables[b], ctx - 1, heads, kv_heads,
                                      head_dim)[0].to(out.dtype)

    def prefill_attention(self, q: Any, pool: Any, layer: int, meta: PrefillMeta, out: Any, heads: int,
                          kv_heads: int, head_dim: int) -> None:
        for i, (r0, start, n) in enumerate(zip(meta.row0.tolist(), meta.starts.tolist(), meta.lens.tolist())):
            out[r0:r0 + n] = self._attend(q[r0:r0 + n], pool, layer, meta.tables[i], start, heads, kv_heads,
                                          head_dim).to(out.dtype)


def pick_ops(device: str, requested: str = "auto") -> Any:
    """The op set for tensors on `device`: "triton" or "torch" as asked; "auto" is Triton on a
    GPU where it imports, plain torch otherwise (a CPU runs Triton only in its interpreter)."""
    if requested == "torch" or (requested == "auto" and not device.startswith("cuda")):
        return TorchOps()
    try:
        return TritonOps()
    except ImportError:
        if requested == "triton":
            raise
        return TorchOps()
