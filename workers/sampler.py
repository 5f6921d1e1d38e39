"""Choosing the next token from a step's logits: greedy, or sampled with temperature, top-k
and top-p, one row per sequence.

Why the random draw is a function of (seed, position) only: a request's tokens must not
depend on what else shares its step (batch composition, preemption and recompute, a prefill
node sampling the first token and a decode node the rest). Each row takes one uniform number,
a hash of its request's seed and the position of the token it samples, and turns it into a
token by inverting the row's (truncated) cumulative distribution, so the same logits, seed
and position always give the same token.

Greedy rows (temperature 0) are exactly argmax, as before sampling existed, so the
exactness checks against the dense reference hold unchanged.

The same code runs on numpy or cupy (`xp`); results come back as host numpy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class SamplingRows:
    """Per-row sampling parameters of one step (host arrays, one entry per sequence).

    temperature 0 is greedy; top_k 0 keeps every token; top_p 1 keeps every token;
    position is the index the sampled token will have in its sequence."""

    temperature: np.ndarray  # float64
    top_p: np.ndarray        # float64
    top_k: np.ndarray        # int64
    seed: np.ndarray         # uint64
    position: np.ndarray     # int64
    logprobs: np.ndarray     # bool: also return the log-probability of the chosen token

    @classmethod
    def greedy(cls, n: int) -> "SamplingRows":
        """n greedy rows without logprobs (what a step without sampling parameters means)."""
        return cls(np.zeros(n), np.ones(n), np.zeros(n, np.int64), np.zeros(n, np.uint64),
                   np.zeros(n, np.int64), np.zeros(n, bool))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: every input bit flips about half of the output bits."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One random number in [0, 1) per (seed, position) pair: a counter-based hash, so it
    needs no generator state and costs the same for a whole batch as for one row."""
    with np.errstate(over="ignore"):
        z = _mix(np.asarray(seeds, np.uint64) + _GOLDEN)
        z = _mix(z + (np.asarray(positions).astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def sample(logits: Any, rows: SamplingRows, xp: Any = np) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (host int32 [n]) and their log-probabilities under the model's unscaled logits
    (host float64 [n]; 0.0 for rows that did not ask) for logits [n, vocab] on `xp`."""
    n = int(logits.shape[0])
    tokens = _host(logits.argmax(axis=-1)).astype(np.int32)
    hot = np.flatnonzero(rows.temperature > 0)
    if len(hot):
        tokens[hot] = _sample_rows(logits[xp.asarray(hot)], rows, hot, xp)
    logprobs = np.zeros(n)
    want = np.flatnonzero(rows.logprobs)
    if len(want):
        z = logits[xp.asarray(want)].astype(xp.float64)
        zmax = z.max(axis=-1, keepdims=True)
        lse = xp.log(xp.exp(z - zmax).sum(axis=-1)) + zmax[:, 0]
        chosen = z[xp.arange(len(want)), xp.asarray(tokens[want].astype(np.int64))]
        logprobs[want] = _host(chosen - lse)
    return tokens, logprobs


def _sample_rows(logits: Any, rows: SamplingRows, idx: np.ndarray, xp: Any) -> np.ndarray:
    """Temperature, then top-k, then top-p over the renormalised rest, then one inverse-CDF
    draw per row. Ties in the sort keep the lower token id first, as argmax does, so top_k 1
    and a tiny top_p are exactly greedy."""
    m, vocab = logits.shape
    z = logits.astype(xp.float64) / xp.asarray(rows.temperature[idx])[:, None]
    order = xp.argsort(-z, axis=-1, kind="stable") if xp is np else xp.argsort(-z, axis=-1)
    zs = xp.take_along_axis(z, order, axis=-1)
    rank = xp.arange(vocab)[None, :]
    k = rows.top_k[idx].astype(np.int64)
    k = np.where(k > 0, np.minimum(k, vocab), vocab)
    zs = xp.where(rank < xp.asarray(k)[:, None], zs, -xp.inf)
    p = xp.exp(zs - zs[:, :1])
    p = p / p.sum(axis=-1, keepdims=True)
    before = xp.cumsum(p, axis=-1) - p  # mass of the more likely tokens
    p = xp.where(before < xp.asarray(rows.top_p[idx])[:, None], p, 0.0)
    cdf = xp.cumsum(p, axis=-1)
    u = uniforms(rows.seed[idx], rows.position[idx])
    target = xp.asarray(u)[:, None] * cdf[:, -1:]
    pick = xp.minimum((cdf <= target).sum(axis=-1), xp.asarray(k - 1))
    return _host(xp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]).astype(np.int32)


def _host(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()
