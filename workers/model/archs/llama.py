"""Llama and Mistral: Mistral is Llama with a sliding window over every layer (none when
config.json's `sliding_window` is null, 4096 tokens when the key is missing, as transformers
reads it)."""
from __future__ import annotations

from kvrt.workers.model.archs.features import Family, Features, activation, refuse_flags, window
from kvrt.workers.model.rope import Rope, parse_rope

SILU = {"silu": "silu"}


def _llama(cfg: dict, layers: int) -> tuple[Rope, Features]:
    refuse_flags(cfg, "mlp_bias", "attention_bias")
    return parse_rope(cfg), Features(windows=(0,) * layers, activation=activation(cfg, "hidden_act", "silu", SILU))


def _mistral(cfg: dict, layers: int) -> tuple[Rope, Features]:
    rope, features = _llama(cfg, layers)
    return rope, Features(windows=(window(cfg, default=4096),) * layers, activation=features.activation)


FAMILIES = {"LlamaForCausalLM": Family(_llama), "MistralForCausalLM": Family(_mistral)}
