"""Prompt logprobs: each prompt token's log-probability given the tokens before it, its rank,
and the likeliest alternatives at its position, for the sequences of a step that ask (vLLM's
`prompt_logprobs`, OpenAI's completions with `echo` and `logprobs`).

Why from the hidden states, in blocks of rows, on the device: a step otherwise takes logits only
where it samples (one row per sequence), while a prompt chunk of T tokens has T x vocab logits
(2,048 tokens of a 151,936-token vocabulary are 1.2 GB in float32). So the LM head runs over
blocks of at most BLOCK_BYTES of logits, and each block is reduced where it lies to what is
answered (the target's log-probability and rank, the top k); only those cross to the host.

Why a value does not depend on how the prompt was chunked: row r of a chunk predicts the token
after it, and the engine sends that token as the row's target even when it is the first token of
the next chunk, so every position is scored from its own row, whichever chunk that row was in;
and each row's log-softmax reads that row's logits alone (a max, a sum of exponentials and a
gather along the row, in float64), so neither the block it falls in nor its neighbours change it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvrt.workers.model.sampler import SamplingRows, top_logprobs

BLOCK_BYTES = 64 << 20  # float64 logits per block of rows (at least one row)


@dataclass
class PromptQuery:
    """What to score in one step: `rows` of the step's flattened tokens (int64, ascending), the
    token each row must have predicted (`targets`, int64) and how many alternatives to give for
    each row (`ks`, int64, 0 allowed)."""

    rows: np.ndarray
    targets: np.ndarray
    ks: np.ndarray


@dataclass
class PromptScores:
    """The answer to a PromptQuery, host arrays in its row order: log softmax(logits)[target]
    (float64 [n]), the target's rank (1 + the tokens with a larger logit; int64 [n]), and the
    ks[i] likeliest tokens of row i with their log-probabilities, most likely first (ties by
    the lower id), flattened in row order (int32 / float64 [sum(ks)])."""

    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def score_prompt(head: Callable[[Any], Any], hidden: Any, query: PromptQuery, vocab: int,
                 xp: Any = np, beat: Callable[[], None] | None = None) -> PromptScores:
    """Score `query` from the step's hidden states `hidden` [rows, d] (on `xp`), where `head`
    maps hidden rows to their logits [m, vocab] (on `xp`); `beat` marks progress after each
    block (a long prompt's scores take as long as many layers: workers/progress.py)."""
    n = len(query.rows)
    lps, ranks = np.zeros(n), np.zeros(n, np.int64)
    ids_out, lps_out = [], []
    per = max(1, BLOCK_BYTES // (8 * max(vocab, 1)))
    for a in range(0, n, per):
        b = min(n, a + per)
        lp, rank, top_ids, top_lps = _score_block(head(hidden[xp.asarray(query.rows[a:b])]), query.targets[a:b],
                                                  query.ks[a:b], xp)
        lps[a:b], ranks[a:b] = lp, rank
        ids_out.append(top_ids)
        lps_out.append(top_lps)
        if beat is not None:
            beat()
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt)) if n else (lambda parts, dt: np.empty(0, dt))
    return PromptScores(lps, ranks, cat(ids_out, np.int32), cat(lps_out, np.float64))


def _score_block(logits: Any, targets: np.ndarray, ks: np.ndarray, xp: Any) -> tuple[np.ndarray, ...]:
    """One block of logits [m, vocab] as the head made them: host (logprobs [m], ranks [m],
    top ids and logprobs flattened, ks[i] of row i). Ranks and the choice of alternatives read
    the logits as they are (float32 to float64 is exact and keeps their order); the values are
    float64, and the exponentials overwrite the one float64 copy (a block's bytes are touched
    a few times, never allocated twice)."""
    m = logits.shape[0]
    at, t = xp.arange(m), xp.asarray(targets.astype(np.int64))
    rank = (logits > logits[at, t][:, None]).sum(axis=-1) + 1
    ids = None
    if m and int(ks.max()) > 0:
        rows = SamplingRows.greedy(m)
        rows.top_logprobs = ks
        ids, _ = top_logprobs(logits, rows, xp)  # the sampler's choice of alternatives: ties by the lower id
    z = logits.astype(xp.float64)  # a copy of our own
    chosen = z[at, t]
    vals = None if ids is None else xp.take_along_axis(z, xp.asarray(ids.astype(np.int64)), axis=-1)
    zmax = z.max(axis=-1, keepdims=True)
    xp.subtract(z, zmax, out=z)
    lse = xp.log(xp.exp(z, out=z).sum(axis=-1)) + zmax[:, 0]
    lp = _host(chosen - lse)
    if ids is None:
        return lp, _host(rank), np.empty(0, np.int32), np.empty(0)
    top = _host(vals - lse[:, None])
    keep = np.arange(ids.shape[1])[None, :] < np.minimum(ks, ids.shape[1])[:, None]
    return lp, _host(rank), ids[keep].astype(np.int32), top[keep]


def _host(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()
