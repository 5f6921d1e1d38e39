"""Routed experts in place of a layer's MLP (Qwen2-MoE, Qwen3-MoE), batched per expert.

Each token's router logits give a softmax over every expert (float32, as transformers computes
it); its top_k experts' gated MLPs run on it and their outputs are summed weighted by those
probabilities (renormalised to sum to 1 with norm_topk_prob). Running each token through its
experts one by one would be top_k small matmuls per token per layer; instead the step's
(token, expert) pairs are sorted by expert and each expert hit runs once over all of its tokens:
at most `count` rounds of array calls per layer, whatever the batch. With tensor parallelism
each rank holds every expert's share of the intermediate width (like the dense MLP) and the
routing, computed identically on every rank from the same hidden states, picks the same
experts everywhere; the partial outputs are summed by the layer's all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass
class ExpertWeights:
    """One layer's experts on one rank, projections as [in, out] blocks: the router
    [hidden, count] (whole on every rank), each expert's gate and up side by side
    [count, hidden, 2 * width] and its down [count, width, hidden] (this rank's width)."""

    router: Any
    gate_up: Any
    down: Any


def route(xp: Any, logits: Any, top_k: int, normalise: bool) -> tuple[Any, Any]:
    """The top_k experts of each token [T, top_k] and their weights [T, top_k] (float32), from
    router logits [T, count]."""
    z = logits.astype(np.float32, copy=False)
    z = z - z.max(axis=-1, keepdims=True)
    probs = xp.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    count = probs.shape[-1]
    chosen = (xp.argpartition(-probs, top_k - 1, axis=-1)[:, :top_k] if top_k < count
              else xp.broadcast_to(xp.arange(count), probs.shape))
    weights = xp.take_along_axis(probs, chosen, axis=-1)
    if normalise:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return chosen, weights


def experts(xp: Any, h: Any, w: ExpertWeights, top_k: int, normalise: bool,
            mm: Callable[[Any, Any], Any], gated: Callable[[Any], Any]) -> Any:
    """The experts' weighted sum [T, hidden] (this rank's partial) for normed hidden states h
    [T, hidden]: `mm` multiplies activations by a weight block, `gated` turns a [n, 2 * width]
    gate-and-up product into the [n, width] input of the down projection."""
    chosen, weights = route(xp, mm(h, w.router), top_k, normalise)
    flat = chosen.ravel()
    order = xp.argsort(flat, kind="stable")
    counts = xp.bincount(flat, minlength=w.router.shape[1])
    counts = counts if isinstance(counts, np.ndarray) else counts.get()  # the loop's bounds, on the host
    out = xp.zeros((h.shape[0], w.down.shape[2]), dtype=np.float32)
    pairs = order // top_k                 # the token of each (token, expert) pair, grouped by expert
    pair_weights = weights.ravel()[order]
    end = 0
    for e in np.flatnonzero(counts):
        start, end = end, end + int(counts[e])
        tokens = pairs[start:end]          # each at most once: a token's experts are distinct
        y = mm(gated(mm(h[tokens], w.gate_up[e])), w.down[e])
        out[tokens] += y * pair_weights[start:end, None]
    return out
