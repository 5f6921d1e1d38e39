"""What sets one checkpoint architecture's network apart from Llama's, as config.json gives it.

The model (workers/model/hf_model.py) is one definition: Llama's layer (RMSNorm, attention
with RoPE and GQA, a gated MLP) with these switches, so an architecture is a reading of its
config.json into `Features` (one file per family beside this one), not a second model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from kvrt.workers.model.rope import Rope

FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_tanh")


class ArchError(ValueError):
    """config.json cannot be served as its architecture; the message names the key."""


@dataclass(frozen=True)
class Experts:
    """Routed experts in place of the MLP (Qwen2-MoE, Qwen3-MoE): each token's router
    probabilities (a softmax over every expert) pick its top_k experts, whose gated MLPs'
    outputs are summed weighted by those probabilities (renormalised to sum to 1 with
    norm_topk_prob)."""

    count: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    routed: tuple[bool, ...]           # per layer: the experts, or the dense MLP
    shared_intermediate_size: int = 0  # Qwen2-MoE: one more expert every token takes, gated by a sigmoid


@dataclass(frozen=True)
class Features:
    """The switches of the one model definition (module docstring)."""

    windows: tuple[int, ...]           # per layer: 0 attends to every earlier key; W to keys at positions > pos - W
    attention_bias: bool = False       # q/k/v biases (Qwen2, Qwen2-MoE)
    qk_norm: bool = False              # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    sliding_rope: Rope | None = None   # the sliding layers' own RoPE (Gemma 3); None: the one RoPE
    norm_plus_one: bool = False        # RMSNorm weights stored as w and applied as 1 + w (Gemma)
    sandwich_norms: bool = False       # a norm after attention and after the MLP too (Gemma 2, 3)
    embed_scale: bool = False          # embeddings times sqrt(hidden_size) in the embedding's dtype (Gemma)
    query_pre_attn_scalar: float = 0.0  # scores scaled by its -1/2 power (Gemma); 0: head_dim's
    attn_softcap: float = 0.0          # scores become c * tanh(scores / c) (Gemma 2); 0: none
    final_softcap: float = 0.0         # the same of the logits (Gemma 2, 3); 0: none
    activation: str = "silu"           # the MLP gate's: silu, or gelu_tanh (Gemma)
    fused_projections: bool = False    # qkv_proj and gate_up_proj, one tensor each (Phi-3)
    experts: Experts | None = None

    @property
    def sliding(self) -> bool:
        return any(self.windows)


def positive_int(cfg: dict, key: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ArchError(f"{key} must be a positive integer, got {v!r}")
    return v


def count(cfg: dict, key: str, default: Any = None) -> int:
    """An integer >= 0."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ArchError(f"{key} must be an integer >= 0, got {v!r}")
    return v


def positive_float(cfg: dict, key: str, default: Any = None) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ArchError(f"{key} must be a positive number, got {v!r}")
    return float(v)


def optional_float(cfg: dict, key: str, default: Any = None) -> float:
    """A positive number, or 0.0 for null (a soft cap that is off)."""
    return 0.0 if cfg.get(key, default) is None else positive_float(cfg, key, default)


def boolean(cfg: dict, key: str, default: bool = False) -> bool:
    v = cfg.get(key, default)
    if not isinstance(v, bool):
        raise ArchError(f"{key} must be a boolean, got {v!r}")
    return v


def refuse_flags(cfg: dict, *keys: str) -> None:
    """Biases the architecture does not have: one switched on is refused, not ignored."""
    for key in keys:
        if cfg.get(key):
            raise ArchError(f"{key} is not supported")


def activation(cfg: dict, key: str, default: str, allowed: dict[str, str]) -> str:
    """The MLP's activation, as one of ACTIVATIONS (`allowed` maps config.json's names)."""
    v = cfg.get(key, default)
    if v not in allowed:
        raise ArchError(f"{key} {v!r} is not supported (supported: {', '.join(allowed)})")
    return allowed[v]


def window(cfg: dict, key: str = "sliding_window", default: Any = None) -> int:
    """A sliding window (tokens each query sees, itself included), 0 for null."""
    return 0 if cfg.get(key, default) is None else positive_int(cfg, key, default)


def layer_types(cfg: dict, layers: int, default: list[str]) -> list[str]:
    """config.json's `layer_types` (transformers 5 writes it), else the family's rule."""
    types = cfg.get("layer_types")
    if types is None:
        return default
    if not (isinstance(types, list) and len(types) == layers and all(t in (FULL, SLIDING) for t in types)):
        raise ArchError(f"layer_types must list {FULL!r} or {SLIDING!r} for each of the {layers} layers, "
                        f"got {types!r}")
    return types


def windows_of(types: list[str], size: int, why: str) -> tuple[int, ...]:
    """Per-layer windows: `size` for each sliding layer. A sliding layer without a window is
    refused (`why` names the setting that took it away)."""
    if SLIDING in types and size <= 0:
        raise ArchError(f"layer_types names {SLIDING!r} layers but {why}")
    return tuple(size if t == SLIDING else 0 for t in types)


@dataclass(frozen=True)
class Family:
    """How one architecture's config.json is read: `read` gives its RoPE and features from
    the config and its number of layers; `defaults` are the values transformers' config class
    gives keys the file lacks, where they differ from the Llama-like ones config.json is
    otherwise read with."""

    read: Callable[[dict, int], tuple[Rope, Features]]
    defaults: dict[str, Any] = field(default_factory=dict)
