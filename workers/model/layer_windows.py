"""Each layer's attention window, read from a checkpoint's config.json as transformers reads it:
0 for full attention, W for a layer that sees the last W tokens.

Why the launcher needs it before any model is loaded: the windows decide how the layers share
the KV pool's pages (ipc/layout.py LayerGroups), which sizes the pools and roots the block keys.
transformers 5 writes `layer_types` ("full_attention" / "sliding_attention", with one
`sliding_window`) for the models that mix them (Gemma 2 and 3, Qwen2 with
`use_sliding_window`); Mistral's config has only `sliding_window`, which then holds for every
layer.
"""
from __future__ import annotations

import json
import os

from kvrt.workers.model.checkpoint import CheckpointError

_MAX_JSON = 16 << 20


def layer_windows(config: dict, num_layers: int) -> list[int]:
    """The windows of `config` (config.json as a dict) for its `num_layers` layers; [] when
    every layer attends to everything. CheckpointError for a layer kind or window it cannot be."""
    types = config.get("layer_types")
    window = config.get("sliding_window")
    if types is None:
        if config.get("model_type") == "mistral" and window:
            types = ["sliding_attention"] * num_layers
        else:
            return []
    if not isinstance(types, list) or len(types) != num_layers:
        raise CheckpointError(f"config.json: layer_types must list the {num_layers} layers, got {types!r}")
    kinds = {"full_attention", "sliding_attention"}
    if not set(types) <= kinds:
        raise CheckpointError(f"config.json: layer types {sorted(set(types) - kinds)} are not served "
                              f"(only {sorted(kinds)})")
    if "sliding_attention" in types and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise CheckpointError(f"config.json: sliding layers need a positive sliding_window, got {window!r}")
    out = [window if t == "sliding_attention" else 0 for t in types]
    return out if any(out) else []


def checkpoint_windows(model_dir: str, num_layers: int) -> list[int]:
    """`layer_windows` of the checkpoint in `model_dir` (its config.json, already checked)."""
    path = os.path.join(model_dir, "config.json")
    if os.path.getsize(path) > _MAX_JSON:
        raise CheckpointError(f"{path} is larger than {_MAX_JSON} bytes")
    with open(path, encoding="utf-8") as f:
        return layer_windows(json.load(f), num_layers)
