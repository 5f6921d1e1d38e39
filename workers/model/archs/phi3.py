"""Phi-3: Llama's layer with q, k and v in one `qkv_proj` and the MLP's gate and up in one
`gate_up_proj` (rows in that order), an optional sliding window over every layer, and
`longrope` (its legacy names `su` and `yarn` included, as transformers renames them for
Phi-3) served within its original context (workers/model/rope.py)."""
from __future__ import annotations

from kvrt.workers.model.archs.features import Family, Features, activation, refuse_flags, window
from kvrt.workers.model.archs.llama import SILU
from kvrt.workers.model.rope import Rope, parse_rope

LEGACY_LONGROPE = ("su", "yarn")


def _phi3(cfg: dict, layers: int) -> tuple[Rope, Features]:
    refuse_flags(cfg, "mlp_bias", "attention_bias")
    chosen = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rp = cfg.get(chosen)
    if isinstance(rp, dict) and rp.get("rope_type", rp.get("type")) in LEGACY_LONGROPE:
        cfg = {**cfg, chosen: {**{k: v for k, v in rp.items() if k != "type"}, "rope_type": "longrope"}}
    return parse_rope(cfg), Features(windows=(window(cfg),) * layers, fused_projections=True,
                                     activation=activation(cfg, "hidden_act", "silu", SILU))


FAMILIES = {"Phi3ForCausalLM": Family(_phi3)}
