"""Request validation at intake: a bad request gets one clear message and changes nothing.

Checked before anything is allocated (ARCHITECTURE.md §7): a request that passes can always
run to the end on this node, alone if need be, so the scheduler never meets one that cannot.
"""
from __future__ import annotations

import numpy as np

from .api import GenerateRequest
from .config import NodeConfig


def validate(req: GenerateRequest, cfg: NodeConfig) -> str:
    """The first problem with `req` on a node configured as `cfg`, or "" if there is none."""
    if not isinstance(req.request_id, str) or not req.request_id:
        return "request_id must be a non-empty string"
    if not isinstance(req.max_new_tokens, int) or isinstance(req.max_new_tokens, bool) or req.max_new_tokens <= 0:
        return f"max_new_tokens must be a positive integer, got {req.max_new_tokens!r}"
    if not isinstance(req.eos_token_id, int) or req.eos_token_id >= cfg.vocab_size:
        return f"eos_token_id must be an integer below the vocabulary size {cfg.vocab_size} (or -1), got {req.eos_token_id!r}"
    prompt = req.prompt
    if len(prompt) == 0:
        return "prompt is empty"
    total = len(prompt) + req.max_new_tokens
    if total > cfg.max_model_len:
        return (f"prompt ({len(prompt)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} exceeds "
                f"the model's max_model_len {cfg.max_model_len}")
    blocks = -(-total // cfg.block_size)
    if blocks > cfg.num_gpu_blocks:
        return (f"the request needs {blocks} KV blocks of {cfg.block_size} tokens, but the device pool "
                f"has only {cfg.num_gpu_blocks} (raise --num-gpu-blocks)")
    lo, hi = int(np.min(prompt)), int(np.max(prompt))
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        return f"token id {bad} is out of range [0, {cfg.vocab_size})"
    return ""
