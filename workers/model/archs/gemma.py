"""Gemma 2 and Gemma 3 (text), read as transformers 5 reads them.

Both: RMSNorm weights applied as 1 + w; a norm after attention and one after the MLP besides
the usual ones before them; embeddings times sqrt(hidden_size), rounded to the embedding's
dtype as transformers and vLLM round it; scores scaled by query_pre_attn_scalar ** -0.5; the
gelu_pytorch_tanh gate; sliding layers (`layer_types`, by default every other one for Gemma 2
and five of each six for Gemma 3) beside full ones; logits soft-capped by
final_logit_softcapping. Gemma 2 also soft-caps the attention scores
(attn_logit_softcapping); Gemma 3's attention in transformers takes no soft cap, whatever the
config says, so neither does kvrt's. Gemma 3 normalises q and k per head (1 + w too) and its
sliding layers have their own RoPE: `rope_parameters` per layer type as transformers 5 writes
it, or transformers 4's `rope_theta` and `rope_scaling` for the full layers and
`rope_local_base_freq` for the sliding ones.
"""
from __future__ import annotations

from kvrt.workers.model.archs.features import (FULL, SLIDING, ArchError, Family, Features, activation, layer_types,
                                               optional_float, positive_float, positive_int, refuse_flags, window,
                                               windows_of)
from kvrt.workers.model.rope import Rope, parse_rope

GELU_TANH = {"gelu_pytorch_tanh": "gelu_tanh"}
DEFAULTS = {"head_dim": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}


def _common(cfg: dict, layers: int, every: int) -> dict:
    """The features both share; `every`: one layer in this many is full by default."""
    refuse_flags(cfg, "attention_bias", "use_bidirectional_attention")
    types = layer_types(cfg, layers, [FULL if (i + 1) % every == 0 else SLIDING for i in range(layers)])
    return dict(windows=windows_of(types, window(cfg, default=4096), "sliding_window is null"),
                norm_plus_one=True, sandwich_norms=True, embed_scale=True,
                query_pre_attn_scalar=positive_float(cfg, "query_pre_attn_scalar", 256),
                activation=activation(cfg, "hidden_activation", "gelu_pytorch_tanh", GELU_TANH))


def _gemma2(cfg: dict, layers: int) -> tuple[Rope, Features]:
    return parse_rope(cfg), Features(**_common(cfg, layers, 2),
                                     attn_softcap=optional_float(cfg, "attn_logit_softcapping", 50.0),
                                     final_softcap=optional_float(cfg, "final_logit_softcapping", 30.0))


def _gemma3_ropes(cfg: dict) -> tuple[Rope, Rope]:
    """The full layers' RoPE and the sliding layers' (module docstring)."""
    rp = cfg.get("rope_parameters") or {}
    if not (isinstance(rp, dict) and set(rp) <= {FULL, SLIDING}
            and all(v is None or isinstance(v, dict) for v in rp.values())):
        raise ArchError(f"rope_parameters must map {FULL!r} and {SLIDING!r} to their RoPE parameters, got {rp!r}")
    full = dict(rp.get(FULL) or {"rope_type": "default"})
    if cfg.get("rope_scaling"):
        if not isinstance(cfg["rope_scaling"], dict):
            raise ArchError(f"rope_scaling must be an object or null, got {cfg['rope_scaling']!r}")
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
    sliding = dict(rp.get(SLIDING) or {"rope_type": "default"})
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", 1e4))
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta", "layer_types")}
    return (parse_rope({**base, "rope_parameters": full}, f"rope_parameters.{FULL}"),
            parse_rope({**base, "rope_parameters": sliding}, f"rope_parameters.{SLIDING}"))


def _gemma3(cfg: dict, layers: int) -> tuple[Rope, Features]:
    full, sliding = _gemma3_ropes(cfg)
    every = positive_int(cfg, "sliding_window_pattern", 6)
    return full, Features(**_common(cfg, layers, every), qk_norm=True, sliding_rope=sliding,
                          final_softcap=optional_float(cfg, "final_logit_softcapping"))


FAMILIES = {"Gemma2ForCausalLM": Family(_gemma2, {**DEFAULTS, "max_position_embeddings": 8192}),
            "Gemma3ForCausalLM": Family(_gemma3, {**DEFAULTS, "max_position_embeddings": 131072})}
