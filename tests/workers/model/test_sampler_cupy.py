"""workers/model/sampler.py on CuPy draws what it draws on NumPy: the same tokens, log-probabilities
and top alternatives for the same logits and rows (the uniforms are host-side and counter-based,
so only the arithmetic's device differs), with biases, penalties, guided masks, non-finite
logits and a real vocabulary's width. Skipped without CUDA; the command that runs it on a lent
GPU machine is in docs/development.md, "GPU validation"."""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.workers.model.sampler import SamplingRows, sample, top_logprobs
from tests.workers.model.test_sampler_guided import pack, random_rows
from tests.gpukit import cuda_cupy

cupy = cuda_cupy()


def batch(seed: int, vocab: int, dtype: type) -> tuple[np.ndarray, SamplingRows]:
    """A mixed step: greedy and sampled rows under every filter, some guided, some biased or
    penalised, some asking for logprobs and alternatives."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    z = (rng.standard_normal((n, vocab)) * rng.choice([0.5, 3.0, 30.0])).astype(dtype)
    if seed % 3 == 0:
        z[rng.random((n, vocab)) < 0.001] = rng.choice([np.inf, -np.inf, np.nan])
    r = random_rows(rng, n)
    r.logprobs[:] = rng.random(n) < 0.5
    r.top_logprobs = rng.choice([0, 1, 5, 20], n)
    r.bias_lens = rng.integers(0, 4, n)
    r.bias_ids = np.concatenate([rng.choice(vocab, k, False) for k in r.bias_lens]).astype(np.int64)
    r.bias_vals = rng.choice([-np.inf, -5.0, 5.0], len(r.bias_ids))
    r.repetition, r.presence, r.frequency = rng.choice([1.0, 1.3], n), rng.choice([0.0, 0.5], n), rng.choice([0.0, 0.2], n)
    r.pen_lens = rng.integers(0, 30, n)
    r.pen_ids = np.concatenate([rng.choice(vocab, k, False) for k in r.pen_lens]).astype(np.int64)
    r.pen_counts = rng.integers(0, 5, len(r.pen_ids))
    guided = np.flatnonzero(rng.random(n) < 0.3)
    keep = rng.random((len(guided), vocab)) < rng.choice([0.001, 0.3])
    keep[np.arange(len(guided)), rng.integers(0, vocab, len(guided))] = True
    r.allowed_rows, r.allowed = guided.astype(np.int64), pack(keep)
    return z, r


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_cupy_draws_what_numpy_draws(vocab, dtype):
    for seed in range(12):
        z, r = batch(seed, vocab, dtype)
        want_t, want_lp = sample(z, r)
        got_t, got_lp = sample(cupy.asarray(z), r, cupy)
        assert isinstance(got_t, np.ndarray) and isinstance(got_lp, np.ndarray)
        assert np.array_equal(got_t, want_t), seed
        assert np.allclose(got_lp, want_lp, rtol=1e-4, atol=1e-4, equal_nan=True), seed
        want_ids, want_vals = top_logprobs(z, r)
        got_ids, got_vals = top_logprobs(cupy.asarray(z), r, cupy)
        assert np.array_equal(got_ids, want_ids), seed
        assert np.allclose(got_vals, want_vals, rtol=1e-4, atol=1e-4, equal_nan=True), seed
