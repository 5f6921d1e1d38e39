"""workers/sampler.py alone: greedy rows are argmax, the filters reduce to greedy at their
limits, draws follow the distribution and depend only on (seed, position), and logprobs are
the model's log-softmax."""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.workers.sampler import SamplingRows, sample

VOCAB = 64


def rows(n: int, temperature=1.0, top_p=1.0, top_k=0, seed=0, position=0, logprobs=False) -> SamplingRows:
    def col(v, dtype):
        return np.broadcast_to(np.asarray(v, dtype), (n,)).copy()
    return SamplingRows(col(temperature, np.float64), col(top_p, np.float64), col(top_k, np.int64),
                        col(seed, np.uint64), col(position, np.int64), col(logprobs, bool))


def logits(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, VOCAB)) * 3


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_temperature_zero_is_argmax():
    z = logits(16)
    z[3, :] = 1.0  # all tied: argmax's first index
    tokens, lp = sample(z, rows(16, temperature=0.0, seed=np.arange(16), position=7))
    assert tokens.tolist() == z.argmax(axis=-1).tolist() and tokens.dtype == np.int32
    assert not lp.any()


@pytest.mark.parametrize("limit", [dict(top_k=1), dict(top_p=1e-9), dict(top_k=1, top_p=0.5)])
def test_top_k_one_and_tiny_top_p_are_greedy(limit):
    z = logits(32, seed=1)
    z[5, :] = 0.5  # ties resolve to the lowest id, as argmax does
    for seed in range(5):
        tokens, _ = sample(z, rows(32, temperature=1.5, seed=seed, position=np.arange(32), **limit))
        assert tokens.tolist() == z.argmax(axis=-1).tolist()


def test_same_seed_and_position_same_token_whatever_the_batch():
    z = logits(8, seed=2)
    alone = [int(sample(z[i:i + 1], rows(1, seed=42, position=100 + i))[0][0]) for i in range(8)]
    together, _ = sample(z, rows(8, seed=42, position=100 + np.arange(8)))
    shuffled = np.random.default_rng(3).permutation(8)
    mixed, _ = sample(z[shuffled], rows(8, seed=42, position=100 + shuffled))
    assert together.tolist() == alone and mixed.tolist() == [alone[i] for i in shuffled]
    # with greedy rows between them, too
    padded = np.concatenate([z, logits(4, seed=9)])
    r = rows(12, seed=42, position=np.concatenate([100 + np.arange(8), np.zeros(4)]))
    r.temperature[8:] = 0.0
    assert sample(padded, r)[0][:8].tolist() == alone


def test_draws_follow_the_distribution():
    """One logits vector, sampled at many positions: token frequencies match the softmax at
    the temperature, and top-k / top-p keep exactly the tokens they should."""
    z = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    batch = np.broadcast_to(z, (n, len(z)))
    for temperature in (1.0, 0.5):
        tokens, _ = sample(batch, rows(n, temperature=temperature, seed=7, position=np.arange(n)))
        freq = np.bincount(tokens, minlength=len(z)) / n
        want = np.exp(z / temperature) / np.exp(z / temperature).sum()
        assert np.abs(freq - want).max() < 0.015, (freq, want)
    tokens, _ = sample(batch, rows(n, top_k=2, seed=8, position=np.arange(n)))
    freq = np.bincount(tokens, minlength=len(z)) / n
    assert set(np.flatnonzero(freq)) == {0, 1} and abs(freq[0] - 1 / (1 + np.exp(-1.0))) < 0.015
    p = np.exp(z) / np.exp(z).sum()  # top_p 0.8: the smallest prefix of the sorted tokens reaching 0.8
    keep = int(np.searchsorted(np.cumsum(p), 0.8)) + 1
    tokens, _ = sample(batch, rows(n, top_p=0.8, seed=9, position=np.arange(n)))
    freq = np.bincount(tokens, minlength=len(z)) / n
    assert set(np.flatnonzero(freq)) == set(range(keep))
    assert np.abs(freq[:keep] - p[:keep] / p[:keep].sum()).max() < 0.015


def test_another_seed_or_position_draws_again():
    z = np.zeros((1, VOCAB))  # uniform: distinct draws are almost surely distinct tokens
    by_seed = {int(sample(z, rows(1, seed=s))[0][0]) for s in range(20)}
    by_pos = {int(sample(z, rows(1, position=p))[0][0]) for p in range(20)}
    assert len(by_seed) > 10 and len(by_pos) > 10


def test_logprobs_are_log_softmax_of_the_unscaled_logits():
    z = logits(6, seed=4)
    r = rows(6, temperature=np.array([0, 0.7, 1, 2, 0, 1.0]), top_k=np.array([0, 5, 0, 0, 0, 3]), seed=5,
             position=np.arange(6), logprobs=np.array([1, 1, 1, 0, 1, 1], bool))
    tokens, lp = sample(z, r)
    want = log_softmax(z)[np.arange(6), tokens]
    assert np.allclose(lp[r.logprobs], want[r.logprobs], rtol=0, atol=1e-12) and lp[3] == 0.0


def test_the_worker_reads_the_batch_fields_or_refuses_them():
    """Empty sampling fields mean every sequence greedy; present ones must have one entry per
    sequence and be in range (else the step fails with an error answer, never a crash)."""
    from kvrt.ipc.protocol import StepBatch
    from kvrt.workers.worker import Worker

    def batch(**kw):
        i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
        return StepBatch(1, i32(5, 6, 7), i32(2, 1), i32(0, 9), i32(0, 1), i32(1, 1), **kw)

    greedy = Worker._sampling(batch())
    assert not greedy.temperature.any() and greedy.temperature.shape == (2,)
    ok = Worker._sampling(batch(temperature=[0.0, 0.8], top_p=[1.0, 0.9], top_k=np.array([0, 4], np.int32),
                                seed=[1, 2 ** 63 - 1], logprobs=np.array([0, 1], np.int32)))
    assert ok.position.tolist() == [2, 10] and ok.logprobs.tolist() == [False, True]
    assert ok.seed.tolist() == [1, 2 ** 63 - 1]
    full = dict(temperature=[0.0, 0.8], top_p=[1.0, 0.9], top_k=np.array([0, 4], np.int32), seed=[1, 2],
                logprobs=np.array([0, 1], np.int32))
    for field, bad in (("temperature", [0.5]), ("top_p", [1.0, 0.0]), ("temperature", [0.0, -1.0]),
                       ("seed", [1, -2]), ("seed", ["a", 1]), ("top_k", np.array([0, -3], np.int32))):
        with pytest.raises(ValueError, match="sampling"):
            Worker._sampling(batch(**{**full, field: bad}))
