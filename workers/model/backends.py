"""Which model backend serves a checkpoint: the array path (NumPy/CuPy, workers/model/hf_model.py)
or the torch backend (workers/model/torch_backend.py). Its own module, free of torch, because
the launcher decides before any worker starts.

The torch backend implements the layer of the architectures named here; a checkpoint of any
other (one the array path learned later) stays on the array path under `auto`, and an explicit
`--model-backend torch` for it is refused, rather than run with a part of its layer missing.
"""
from __future__ import annotations

import importlib.util
from typing import Any

TORCH_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
BACKENDS = ("auto", "array", "torch")


def torch_problem(config: Any, kv_cache_dtype: str = "auto") -> str:
    """What of a checkpoint's network (its `ModelConfig`) or of its KV blocks (`--kv-cache-dtype`)
    the torch layer does not implement, or "": an architecture outside TORCH_ARCHITECTURES, a
    switch of the one model definition that those architectures' checkpoints may still set (a
    sliding window in Qwen2's config, say, which would also make the pool's pages layer groups),
    which the torch layer would otherwise ignore, or FP8 blocks (its kernels store and read
    K/V as they are, without the e4m3 encoding)."""
    if config.arch not in TORCH_ARCHITECTURES:
        return f"the torch backend runs {', '.join(TORCH_ARCHITECTURES)}, not {config.arch}"
    if kv_cache_dtype != "auto":
        return (f"the torch backend keeps K/V in float16 or float32 blocks, not --kv-cache-dtype "
                f"{kv_cache_dtype} (FP8 e4m3)")
    f = config.features
    unsupported = {"sliding-window layers (and the layer groups of the KV pool they make)": f.sliding,
                   "a second RoPE": f.sliding_rope is not None,
                   "1 + w norms": f.norm_plus_one, "post-attention and post-MLP norms": f.sandwich_norms,
                   "an embedding scale": f.embed_scale, "query_pre_attn_scalar": bool(f.query_pre_attn_scalar),
                   "soft-capping": bool(f.attn_softcap or f.final_softcap),
                   f"the {f.activation} activation": f.activation != "silu",
                   "fused projections": f.fused_projections, "routed experts": f.experts is not None}
    named = [name for name, present in unsupported.items() if present]
    return f"the torch backend does not implement {', '.join(named)} of this {config.arch}" if named else ""


def resolve_backend(requested: str, device: str, config: Any, kv_cache_dtype: str = "auto") -> str:
    """`requested` ("auto", "array" or "torch") for a checkpoint of `config` (its `ModelConfig`)
    on `device` with `--kv-cache-dtype kv_cache_dtype`: auto is torch on a GPU where torch and
    Triton are installed (looked up, not imported) and the torch layer implements the network
    and its KV blocks, else array. ValueError for torch on what it does not implement, or an
    unknown setting."""
    if requested not in BACKENDS:
        raise ValueError(f"--model-backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    problem = torch_problem(config, kv_cache_dtype)
    if requested == "torch" and problem:
        raise ValueError(f"--model-backend torch: {problem}: use --model-backend array")
    if requested != "auto":
        return requested
    have = all(importlib.util.find_spec(m) is not None for m in ("torch", "triton"))
    return "torch" if device == "cuda" and have and not problem else "array"
