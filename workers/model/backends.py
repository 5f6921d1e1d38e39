"""Which model backend serves a checkpoint: the array path (NumPy/CuPy, workers/model/hf_model.py)
or the torch backend (workers/model/torch_backend.py). Its own module, free of torch, because
the launcher decides before any worker starts.

The torch backend implements the layer of the architectures named here; a checkpoint of any
other (one the array path learned later) stays on the array path under `auto`, and an explicit
`--model-backend torch` for it is refused, rather than run with a part of its layer missing.
"""
from __future__ import annotations

import importlib.util

TORCH_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
BACKENDS = ("auto", "array", "torch")


def resolve_backend(requested: str, device: str, arch: str) -> str:
    """`requested` ("auto", "array" or "torch") for a checkpoint of `arch` on `device`: auto is
    torch on a GPU where torch and Triton are installed (looked up, not imported) and the
    architecture is one it implements, else array. ValueError for torch on an architecture it
    does not implement, or an unknown setting."""
    if requested not in BACKENDS:
        raise ValueError(f"--model-backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "torch" and arch not in TORCH_ARCHITECTURES:
        raise ValueError(f"--model-backend torch runs {', '.join(TORCH_ARCHITECTURES)}, not {arch}: "
                         f"use --model-backend array")
    if requested != "auto":
        return requested
    have = all(importlib.util.find_spec(m) is not None for m in ("torch", "triton"))
    return "torch" if device == "cuda" and have and arch in TORCH_ARCHITECTURES else "array"
