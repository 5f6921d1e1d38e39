"""Request validation at intake: a bad request gets one clear message and changes nothing.

Checked before anything is allocated: a request that passes can always
run to the end on this node, alone if need be, so the scheduler never meets one that cannot.
"""
from __future__ import annotations

import math
import reprlib
import secrets

import numpy as np

from kvrt.runtime.client.api import (MAX_LOGIT_BIAS, MAX_ON_BEHALF_OF_BYTES, MAX_TOP_LOGPROBS, GenerateRequest,
                                     cache_salt_problem,
                                     request_id_problem)
from kvrt.runtime.engine.grammars import guided_problem
from kvrt.runtime.node.config import NodeConfig


_NESTED = reprlib.Repr()  # a container's repr a few levels deep at most: a nested one cannot recurse far


def show(value: object, limit: int = 40) -> str:
    """A value as an error message may quote it: its repr, cut short (a hostile value can be
    as long as a whole message, and nest as deep as one), and its type (True and 1 look alike
    otherwise)."""
    r = _NESTED.repr(value) if isinstance(value, (list, tuple, dict, set)) else repr(value)
    if len(r) > limit:
        r = r[:limit - 3] + "..."
    return f"{r} ({type(value).__name__})"


def is_int(value: object) -> bool:
    """An integer that is not a bool (msgpack's true is Python's True, and True == 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


MAX_TEMPERATURE = 100.0  # far past where the distribution is uniform in practice
MAX_STOP_TOKEN_IDS = 64
SEED_LIMIT = 1 << 63     # seeds are in [0, SEED_LIMIT): one int64 on every path
MAX_BIAS = 100.0         # |logit bias|, as OpenAI's API bounds it
MAX_PENALTY = 2.0        # |frequency or presence penalty|, as OpenAI's API bounds them
MAX_REPETITION = 10.0    # repetition penalty in (0, MAX_REPETITION]


def is_number(value: object) -> bool:
    """A finite int or float that is not a bool (a client may send 1 for 1.0)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def sampling_problem(req: object, vocab_size: int) -> str:
    """The first problem with the sampling fields of a request (GenerateRequest or a P->D
    preallocation, which carries the same fields), or ""."""
    t = req.temperature
    if not is_number(t) or not 0 <= t <= MAX_TEMPERATURE:
        return f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0: greedy), got {show(t)}"
    if not is_number(req.top_p) or not 0 < req.top_p <= 1:
        return f"top_p must be a number in (0, 1], got {show(req.top_p)}"
    if not is_number(req.min_p) or not 0 <= req.min_p <= 1:
        return f"min_p must be a number in [0, 1] (0: no limit), got {show(req.min_p)}"
    if not is_int(req.top_k) or not 0 <= req.top_k <= vocab_size:
        return f"top_k must be an integer in [0, {vocab_size}] (0: no limit), got {show(req.top_k)}"
    if req.seed is not None and (not is_int(req.seed) or not 0 <= req.seed < SEED_LIMIT):
        return f"seed must be an integer in [0, 2**63) or null, got {show(req.seed)}"
    stops = req.stop_token_ids
    if not isinstance(stops, list) or len(stops) > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, got {show(stops)}"
    for tok in stops:
        if not is_int(tok) or not 0 <= tok < vocab_size:
            return f"stop_token_ids must hold token ids in [0, {vocab_size}), got {show(tok)}"
    if not isinstance(req.logprobs, bool):
        return f"logprobs must be true or false, got {show(req.logprobs)}"
    if not is_int(req.top_logprobs) or not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {show(req.top_logprobs)}"
    return adjustment_problem(req, vocab_size)


def adjustment_problem(req: object, vocab_size: int) -> str:
    """The first problem with a request's logit bias, min_tokens and penalties, or ""."""
    bias = req.logit_bias
    if not isinstance(bias, list) or len(bias) > MAX_LOGIT_BIAS:
        return f"logit_bias must be a list of at most {MAX_LOGIT_BIAS} [token id, bias] pairs, got {show(bias)}"
    seen = set()
    for pair in bias:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not is_int(pair[0])
                or not 0 <= pair[0] < vocab_size or not is_number(pair[1]) or not -MAX_BIAS <= pair[1] <= MAX_BIAS):
            return (f"logit_bias must hold [token id in [0, {vocab_size}), bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}]] "
                    f"pairs, got {show(pair)}")
        if pair[0] in seen:
            return f"logit_bias names token {pair[0]} twice"
        seen.add(pair[0])
    if not is_int(req.min_tokens) or not 0 <= req.min_tokens <= (req.max_new_tokens if is_int(req.max_new_tokens) else 0):
        return f"min_tokens must be an integer in [0, max_new_tokens], got {show(req.min_tokens)}"
    r = req.repetition_penalty
    if not is_number(r) or not 0 < r <= MAX_REPETITION:
        return f"repetition_penalty must be a number in (0, {MAX_REPETITION:g}] (1: off), got {show(r)}"
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(req, name)
        if not is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
            return f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: off), got {show(v)}"
    return ""


def sampling_of(req: object) -> dict:
    """A validated request's sampling fields as Sequence keyword arguments. A request without
    a seed gets one drawn here, once, so every step (and a decode node) uses the same."""
    if req.seed is None:
        req.seed = secrets.randbelow(SEED_LIMIT)
    return dict(temperature=float(req.temperature), top_p=float(req.top_p), top_k=int(req.top_k), min_p=float(req.min_p),
                seed=int(req.seed), stop_token_ids=frozenset(req.stop_token_ids), logprobs=req.logprobs,
                top_logprobs=int(req.top_logprobs), logit_bias={int(t): float(b) for t, b in req.logit_bias},
                min_tokens=int(req.min_tokens), repetition_penalty=float(req.repetition_penalty),
                frequency_penalty=float(req.frequency_penalty), presence_penalty=float(req.presence_penalty))


def request_pages(cfg: NodeConfig, blocks: int) -> int:
    """The most device blocks a request of `blocks` blocks of tokens holds at once: one per
    block for the first layer group, and as many for every other full-attention group; a
    sliding group holds at most its window and a step's chunk (runtime/cache/groups.py)."""
    bs = cfg.block_size
    chunk = -(-cfg.max_num_batched_tokens // bs)
    return blocks + sum(blocks if w == 0 else min(blocks, -(-w // bs) + chunk + 2)
                        for w in cfg.kv_groups.side_windows)


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
    who = req.on_behalf_of
    if not isinstance(who, str) or len(who.encode("utf-8", "replace")) > MAX_ON_BEHALF_OF_BYTES \
            or not who.isprintable():
        return f"on_behalf_of must be a printable string of at most {MAX_ON_BEHALF_OF_BYTES} bytes, got {show(who)}"
    if problem := sampling_problem(req, cfg.vocab_size):
        return problem
    k = req.prompt_logprobs
    if k is not None and (not is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS):
        return f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or null, got {show(k)}"
    if problem := cache_salt_problem(req.cache_salt):
        return problem
    if problem := guided_problem(req.guided):
        return problem
    if req.guided is not None and not cfg.model_dir:
        return "guided decoding needs a tokenizer: serve a checkpoint (kvrt launch --model DIR)"
    if req.guided is not None and req.eos_token_id < 0:
        return "guided decoding needs an eos_token_id: the grammar's answer ends with it"
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
    pages = request_pages(cfg, blocks)
    if pages > cfg.num_gpu_blocks:
        return (f"the request needs {pages} KV blocks of {cfg.block_size} tokens, but the device pool "
                f"has only {cfg.num_gpu_blocks} (raise --num-gpu-blocks)")
    lo, hi = int(np.min(prompt)), int(np.max(prompt))
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        return f"token id {bad} is out of range [0, {cfg.vocab_size})"
    return ""
