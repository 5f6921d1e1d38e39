"""Qwen2, Qwen3 and their mixtures of experts, read as transformers 5 reads them.

- Qwen2 has q/k/v biases, Qwen3 a per-head RMSNorm of q and k; Qwen2-MoE takes Qwen2's
  attention (biases unless `qkv_bias` is false), Qwen3-MoE Qwen3's.
- Sliding windows: only with `use_sliding_window`. Qwen2 and Qwen3 slide the layers that
  `layer_types` names (by default those from `max_window_layers` on); Qwen3-MoE slides every
  layer; Qwen2-MoE the layers `layer_types` names (by default every other one below
  `max_window_layers`).
- Experts: a layer routes unless it is in `mlp_only_layers` or off the `decoder_sparse_step`
  grid; Qwen2-MoE adds its gated shared expert.
Defaults for missing keys are transformers' config classes'.
"""
from __future__ import annotations

from kvrt.workers.model.archs.features import (FULL, SLIDING, ArchError, Experts, Family, Features, activation,
                                               boolean, count, layer_types, positive_int, refuse_flags, window,
                                               windows_of)
from kvrt.workers.model.archs.llama import SILU
from kvrt.workers.model.rope import Rope, parse_rope

NO_WINDOW = "use_sliding_window is false (or sliding_window null)"


def _sliding_size(cfg: dict) -> int:
    """The window transformers applies: `sliding_window` (4096 when missing) with
    `use_sliding_window`, none without."""
    return window(cfg, default=4096) if boolean(cfg, "use_sliding_window") else 0


def _dense_windows(cfg: dict, layers: int) -> tuple[int, ...]:
    size = _sliding_size(cfg)
    first = count(cfg, "max_window_layers", 28)
    default = [SLIDING if size and i >= first else FULL for i in range(layers)]
    return windows_of(layer_types(cfg, layers, default), size, NO_WINDOW)


def _qwen2(cfg: dict, layers: int) -> tuple[Rope, Features]:
    refuse_flags(cfg, "mlp_bias", "attention_bias")  # its q/k/v biases are its architecture, not this flag
    return parse_rope(cfg), Features(windows=_dense_windows(cfg, layers), attention_bias=True,
                                     activation=activation(cfg, "hidden_act", "silu", SILU))


def _qwen3(cfg: dict, layers: int) -> tuple[Rope, Features]:
    refuse_flags(cfg, "mlp_bias", "attention_bias")
    return parse_rope(cfg), Features(windows=_dense_windows(cfg, layers), qk_norm=True,
                                     activation=activation(cfg, "hidden_act", "silu", SILU))


def _experts(cfg: dict, layers: int, count_keys: tuple[str, ...], defaults: tuple[int, int, int, int]) -> Experts:
    """The experts of a MoE config: `count_keys` are the names its expert count may be under;
    `defaults` its config class's (count, top_k, expert MLP width, shared expert width: 0 for
    none)."""
    experts, top_k, size, shared = defaults
    given = [k for k in count_keys if cfg.get(k) is not None]
    if len({repr(cfg[k]) for k in given}) > 1:
        raise ArchError(f"{' and '.join(given)} disagree: {', '.join(repr(cfg[k]) for k in given)}")
    experts = positive_int(cfg, given[0]) if given else experts
    only = cfg.get("mlp_only_layers", [])
    if not (isinstance(only, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in only)):
        raise ArchError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
    step = positive_int(cfg, "decoder_sparse_step", 1)
    k = positive_int(cfg, "num_experts_per_tok", top_k)
    if k > experts:
        raise ArchError(f"num_experts_per_tok {k} exceeds the {experts} experts")
    return Experts(count=experts, top_k=k, intermediate_size=positive_int(cfg, "moe_intermediate_size", size),
                   norm_topk_prob=boolean(cfg, "norm_topk_prob"),
                   routed=tuple(i not in only and (i + 1) % step == 0 for i in range(layers)),
                   shared_intermediate_size=(positive_int(cfg, "shared_expert_intermediate_size", shared)
                                             if shared else 0))


def _qwen3_moe(cfg: dict, layers: int) -> tuple[Rope, Features]:
    refuse_flags(cfg, "mlp_bias", "attention_bias")
    return parse_rope(cfg), Features(
        windows=(_sliding_size(cfg),) * layers, qk_norm=True, activation=activation(cfg, "hidden_act", "silu", SILU),
        experts=_experts(cfg, layers, ("num_experts", "num_local_experts"), (128, 8, 768, 0)))


def _qwen2_moe(cfg: dict, layers: int) -> tuple[Rope, Features]:
    refuse_flags(cfg, "mlp_bias")
    size = _sliding_size(cfg)
    first = count(cfg, "max_window_layers", 28)
    default = [SLIDING if size and (i + 1) % 2 and i < first else FULL for i in range(layers)]
    windows = windows_of(layer_types(cfg, layers, default), size, NO_WINDOW)
    return parse_rope(cfg), Features(
        windows=windows, attention_bias=boolean(cfg, "qkv_bias", True),
        activation=activation(cfg, "hidden_act", "silu", SILU),
        experts=_experts(cfg, layers, ("num_experts",), (60, 4, 1408, 5632)))


FAMILIES = {"Qwen2ForCausalLM": Family(_qwen2), "Qwen3ForCausalLM": Family(_qwen3),
            "Qwen2MoeForCausalLM": Family(_qwen2_moe), "Qwen3MoeForCausalLM": Family(_qwen3_moe)}
