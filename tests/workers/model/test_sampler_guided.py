"""workers/model/sampler.py's guided masks: a token outside a row's mask is never chosen, greedy or
sampled, with or without filters, biases and non-finite logits; unguided rows of the same
batch are untouched; the two ways of unpacking a mask agree; the worker refuses masks that do
not fit its batch or allow nothing."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.ipc import protocol as P
from kvrt.workers.model.sampler import SamplingRows, sample, shift_unpack, unpack_mask
from kvrt.workers.worker import _guided


def pack(keep: np.ndarray) -> np.ndarray:
    """bool [g, vocab] -> int32 words [g, ceil(vocab / 32)] (bit t % 32 of word t // 32)."""
    g, vocab = keep.shape
    words = -(-vocab // 32)
    padded = np.zeros((g, words * 32), bool)
    padded[:, :vocab] = keep
    return np.packbits(padded, axis=-1, bitorder="little").view("<i4").astype(np.int32)


def random_rows(rng: np.random.Generator, n: int) -> SamplingRows:
    """n rows, greedy and sampled, under every filter, each with its seed and position."""
    r = SamplingRows.greedy(n)
    r.temperature[:] = rng.choice([0.0, 0.7, 1.0, 2.0], n)
    r.top_k[:] = rng.choice([0, 1, 3, 50], n)
    r.top_p[:] = rng.choice([1.0, 0.9, 0.3], n)
    r.min_p[:] = rng.choice([0.0, 0.1], n)
    r.seed[:] = rng.integers(0, 2**63, n, dtype=np.uint64)
    r.position[:] = rng.integers(0, 1000, n)
    return r


@st.composite
def guided_batches(draw):
    n = draw(st.integers(1, 12))  # (past CHUNK rows: masked a chunk at a time)
    vocab = draw(st.sampled_from([5, 32, 33, 300, 1000]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    dtype = draw(st.sampled_from([np.float32, np.float64]))  # (float32: by bit operations)
    z = (rng.standard_normal((n, vocab)) * draw(st.sampled_from([0.5, 3.0, 30.0]))).astype(dtype)
    if draw(st.booleans()):  # non-finite logits here and there
        z[rng.random((n, vocab)) < 0.05] = rng.choice([np.inf, -np.inf, np.nan])
    guided = np.flatnonzero(rng.random(n) < 0.7)
    density = draw(st.sampled_from([0.002, 0.05, 0.5, 1.0]))
    keep = rng.random((len(guided), vocab)) < density
    keep[np.arange(len(guided)), rng.integers(0, vocab, len(guided))] = True  # never empty
    r = random_rows(rng, n)
    if draw(st.booleans()):  # ban some tokens, perhaps every allowed one of a row
        bans = [np.flatnonzero(keep[j]) if j < len(guided) and rng.random() < 0.3 else rng.choice(vocab, 2, False)
                for j in range(n)]
        r.bias_lens = np.array([len(b) for b in bans])
        r.bias_ids = np.concatenate(bans).astype(np.int64)
        r.bias_vals = np.full(len(r.bias_ids), -np.inf)
    r.allowed_rows, r.allowed = guided.astype(np.int64), pack(keep)
    return z, r, guided, keep


@settings(max_examples=200, deadline=None)
@given(guided_batches())
def test_a_token_outside_the_mask_is_never_chosen(batch):
    z, r, guided, keep = batch
    before = z.copy()
    tokens, _ = sample(z, r)
    assert np.array_equal(z, before, equal_nan=True)  # the model's logits are left as they were
    for j, row in enumerate(guided):
        assert keep[j, tokens[row]], (row, tokens[row])


def test_greedy_guided_rows_are_the_argmax_over_the_allowed_tokens_and_others_unchanged():
    rng = np.random.default_rng(3)
    z = rng.standard_normal((4, 200)).astype(np.float32)
    keep = rng.random((2, 200)) < 0.1
    r = SamplingRows.greedy(4)
    r.allowed_rows, r.allowed = np.array([1, 3]), pack(keep)
    tokens, _ = sample(z, r)
    assert tokens[0] == z[0].argmax() and tokens[2] == z[2].argmax()
    for j, row in enumerate((1, 3)):
        assert tokens[row] == np.flatnonzero(keep[j])[z[row, keep[j]].argmax()]


def test_sampled_guided_rows_follow_the_renormalised_distribution():
    vocab, draws = 40, 4000
    z = np.random.default_rng(1).standard_normal(vocab).astype(np.float32)
    keep = np.zeros(vocab, bool)
    keep[[3, 7, 8, 20]] = True
    r = SamplingRows.greedy(draws)
    r.temperature[:] = 1.0
    r.seed[:] = 11
    r.position[:] = np.arange(draws)
    r.allowed_rows, r.allowed = np.arange(draws), pack(np.tile(keep, (draws, 1)))
    tokens, _ = sample(np.tile(z, (draws, 1)), r)
    p = np.exp(z[keep] - z[keep].max())
    p /= p.sum()
    seen = np.array([(tokens == t).mean() for t in np.flatnonzero(keep)])
    assert set(tokens.tolist()) <= set(np.flatnonzero(keep).tolist())
    assert np.abs(seen - p).max() < 0.04


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 151_936])
def test_unpacking_by_bytes_and_by_shifts_agree(vocab):
    keep = np.random.default_rng(vocab).random((3, vocab)) < 0.5
    words = pack(keep)
    assert np.array_equal(unpack_mask(words, vocab), keep)
    assert np.array_equal(shift_unpack(words, vocab, np), keep)


def _batch(n: int, **kw) -> P.StepBatch:
    e = np.zeros(n, np.int32)
    return P.StepBatch(1, e, np.ones(n, np.int32), e, e, np.ones(n, np.int32) * 0, **kw)


def test_the_worker_reads_guided_masks_or_refuses_them():
    assert _guided(_batch(2), 2, 64) == (None, None)
    ok = np.ones(2, np.int32)
    rows, mask = _guided(_batch(2, guided_rows=np.array([1], np.int32), guided_mask=ok), 2, 64)
    assert rows.tolist() == [1] and mask.shape == (1, 2)
    for bad in (dict(guided_rows=np.array([2], np.int32), guided_mask=ok),        # no such row
                dict(guided_rows=np.array([0], np.int32), guided_mask=ok[:1]),    # short mask
                dict(guided_rows=np.array([0, 0], np.int32), guided_mask=np.ones(4, np.int32)),  # a row twice
                dict(guided_rows=np.array([0], np.int32), guided_mask=np.zeros(2, np.int32))):  # allows nothing
        with pytest.raises(ValueError, match="guided"):
            _guided(_batch(2, **bad), 2, 64)


def test_a_step_with_the_most_guided_rows_fits_its_ring():
    vocab = 151_936
    g = P.max_guided_rows(vocab)
    assert g == 13
    words = -(-vocab // 32)
    n = 256
    batch = _batch(n, guided_rows=np.arange(g, dtype=np.int32), guided_mask=np.ones(g * words, np.int32))
    batch.tokens = np.zeros(8192, np.int32)
    batch.tables = np.zeros(8192, np.int32)
    assert len(P.PROTOCOL.encode(batch)) < (1 << 20) // 2
