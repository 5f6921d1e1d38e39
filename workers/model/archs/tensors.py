"""Where each weight of a layer is in a checkpoint (Hugging Face names), for every architecture:
what `inspect` checks is there with its shape, and what the model loads, from one description,
so the two never disagree.

A projection is `Rows` of a tensor: all of `q_proj.weight`, or the q rows of Phi-3's fused
`qkv_proj.weight`; the model takes each rank's share of those rows (tensor parallel) from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rows:
    """Rows [offset, offset + count) of the [total, width] tensor `name`."""

    name: str
    offset: int
    count: int
    total: int
    width: int

    @classmethod
    def whole(cls, name: str, rows: int, width: int) -> "Rows":
        return cls(name, 0, rows, rows, width)


@dataclass(frozen=True)
class Mlp:
    """A gated MLP: act(x gate^T) * (x up^T), then down ([hidden, width])."""

    gate: Rows
    up: Rows
    down: str
    width: int


@dataclass(frozen=True)
class LayerTensors:
    attn_norm: str
    mlp_norm: str                  # the norm before the MLP (or the experts)
    post_attn_norm: str | None     # Gemma's norms after attention and after the MLP
    post_mlp_norm: str | None
    q: Rows
    k: Rows
    v: Rows
    o: str
    biases: tuple[str, str, str] | None  # q/k/v biases
    q_norm: str | None
    k_norm: str | None
    mlp: Mlp | None                # the dense MLP, or None where experts route
    router: str | None             # [experts, hidden]
    experts: tuple[Mlp, ...]
    shared: Mlp | None             # Qwen2-MoE's shared expert and its [1, hidden] gate
    shared_gate: str | None

    def shapes(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
        """Every tensor of the layer with the shape it must have."""
        out: dict[str, tuple[int, ...]] = {}
        for n in (self.attn_norm, self.mlp_norm, self.post_attn_norm, self.post_mlp_norm):
            if n is not None:
                out[n] = (hidden,)
        for r in (self.q, self.k, self.v):
            out[r.name] = (r.total, r.width)
        out[self.o] = (hidden, heads * head_dim)
        if self.biases is not None:
            out.update(zip(self.biases, [(heads * head_dim,), (kv_heads * head_dim,), (kv_heads * head_dim,)]))
        for n in (self.q_norm, self.k_norm):
            if n is not None:
                out[n] = (head_dim,)
        for m in (self.mlp, self.shared, *self.experts):
            if m is not None:
                out[m.gate.name] = (m.gate.total, hidden)
                out[m.up.name] = (m.up.total, hidden)
                out[m.down] = (hidden, m.width)
        if self.router is not None:
            out[self.router] = (len(self.experts), hidden)
        if self.shared_gate is not None:
            out[self.shared_gate] = (1, hidden)
        return out


def _mlp(prefix: str, width: int, hidden: int, fused: bool) -> Mlp:
    if fused:
        name = prefix + "gate_up_proj.weight"
        return Mlp(Rows(name, 0, width, 2 * width, hidden), Rows(name, width, width, 2 * width, hidden),
                   prefix + "down_proj.weight", width)
    return Mlp(Rows.whole(prefix + "gate_proj.weight", width, hidden),
               Rows.whole(prefix + "up_proj.weight", width, hidden), prefix + "down_proj.weight", width)


def layer_tensors(c: Any, i: int) -> LayerTensors:
    """Layer i's tensors in a checkpoint of config `c` (a checkpoint.ModelConfig)."""
    f, d = c.features, c.hidden_size
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if f.fused_projections:
        fused = a + "qkv_proj.weight"
        total = q + 2 * kv
        qkv = (Rows(fused, 0, q, total, d), Rows(fused, q, kv, total, d), Rows(fused, q + kv, kv, total, d))
    else:
        qkv = (Rows.whole(a + "q_proj.weight", q, d), Rows.whole(a + "k_proj.weight", kv, d),
               Rows.whole(a + "v_proj.weight", kv, d))
    ex = f.experts
    routed = ex is not None and ex.routed[i]
    mlp = None if routed else _mlp(p + "mlp.", c.intermediate_size, d, f.fused_projections)
    experts = (tuple(_mlp(p + f"mlp.experts.{e}.", ex.intermediate_size, d, False) for e in range(ex.count))
               if routed else ())
    shared = routed and ex.shared_intermediate_size > 0
    return LayerTensors(
        attn_norm=p + "input_layernorm.weight",
        mlp_norm=p + ("pre_feedforward_layernorm.weight" if f.sandwich_norms else "post_attention_layernorm.weight"),
        post_attn_norm=p + "post_attention_layernorm.weight" if f.sandwich_norms else None,
        post_mlp_norm=p + "post_feedforward_layernorm.weight" if f.sandwich_norms else None,
        q=qkv[0], k=qkv[1], v=qkv[2], o=a + "o_proj.weight",
        biases=(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if f.attention_bias else None,
        q_norm=a + "q_norm.weight" if f.qk_norm else None, k_norm=a + "k_norm.weight" if f.qk_norm else None,
        mlp=mlp, router=p + "mlp.gate.weight" if routed else None, experts=experts,
        shared=_mlp(p + "mlp.shared_expert.", ex.shared_intermediate_size, d, False) if shared else None,
        shared_gate=p + "mlp.shared_expert_gate.weight" if shared else None)
