"""Request validation at intake: a bad request gets one clear message and changes nothing.

Checked before anything is allocated (ARCHITECTURE.md §7): a request that passes can always
run to the end on this node, alone if need be, so the scheduler never meets one that cannot.
"""
from __future__ import annotations

import numpy as np

from .api import GenerateRequest, request_id_problem
from .config import NodeConfig


def show(value: object, limit: int = 40) -> str:
    """A value as an error message may quote it: its repr, cut short (a hostile value can be
    as long as a whole message), and its type (True and 1 look alike otherwise)."""
    r = repr(value)
    if len(r) > limit:
        r = r[:limit - 3] + "..."
    return f"{r} ({type(value).__name__})"


def is_int(value: object) -> bool:
    """An integer that is not a bool (msgpack's true is Python's True, and True == 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def validate(req: GenerateRequest, cfg: NodeConfig) -> str:
    """The first problem with `req` on a node configured as `cfg`, or "" if there is none.
    Every field is checked for its exact type here, before any of it touches state."""
    problem = request_id_problem(req.request_id)
    if problem:
        return problem
    if not is_int(req.max_new_tokens) or req.max_new_tokens <= 0:
        return f"max_new_tokens must be a positive integer, got {show(req.max_new_tokens)}"
    if not is_int(req.eos_token_id) or not -1 <= req.eos_token_id < cfg.vocab_size:
        return (f"eos_token_id must be an integer below the vocabulary size {cfg.vocab_size} (or -1 for none), "
                f"got {show(req.eos_token_id)}")
    for name in ("use_cache", "stream"):
        if not isinstance(getattr(req, name), bool):
            return f"{name} must be true or false, got {show(getattr(req, name))}"
    prompt = req.prompt
    if not isinstance(prompt, np.ndarray) or prompt.ndim != 1 or prompt.dtype != np.int32:
        return f"prompt must be int32 token ids, got {show(prompt)}"
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
