"""workers/model/sampler.py alone: greedy rows are argmax, the filters reduce to greedy at their
limits, draws follow the distribution (a chi-square test against a float64 reference) and
depend only on (logits, parameters, seed, position), the chosen token is always one the
filters keep, and logprobs are the model's log-softmax."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.workers.model import sampler
from kvrt.workers.model.sampler import SamplingRows, sample

VOCAB = 64


def rows(n: int, temperature=1.0, top_p=1.0, top_k=0, seed=0, position=0, logprobs=False, min_p=0.0) -> SamplingRows:
    def col(v, dtype):
        return np.broadcast_to(np.asarray(v, dtype), (n,)).copy()
    return SamplingRows(col(temperature, np.float64), col(top_p, np.float64), col(top_k, np.int64),
                        col(seed, np.uint64), col(position, np.int64), col(logprobs, bool), col(min_p, np.float64))


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


@pytest.mark.parametrize("t", [1e-308, 5e-324, 1e-40, 9e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(t):
    """Logits divided by 1e-308 overflow float32: such a row sampled token 0. The limit of the
    distribution as the temperature falls is the argmax, so that is what it gets."""
    z = logits(8)
    tokens, _ = sample(z, rows(8, temperature=t, seed=np.arange(8), position=3))
    assert tokens.tolist() == z.argmax(axis=-1).tolist()


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
    assert np.allclose(lp[r.logprobs], want[r.logprobs], rtol=0, atol=1e-5)  # float32 and lp[3] == 0.0


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
    assert ok.seed.tolist() == [1, 2 ** 63 - 1] and ok.min_p.tolist() == [0.0, 0.0]  # min_p may be absent
    assert Worker._sampling(batch(temperature=[0.0, 0.8], top_p=[1.0, 0.9], top_k=np.array([0, 4], np.int32),
                                  seed=[1, 2], logprobs=np.array([0, 1], np.int32), min_p=[0.0, 0.25])).min_p[1] == 0.25
    full = dict(temperature=[0.0, 0.8], top_p=[1.0, 0.9], top_k=np.array([0, 4], np.int32), seed=[1, 2],
                logprobs=np.array([0, 1], np.int32))
    for field, bad in (("temperature", [0.5]), ("top_p", [1.0, 0.0]), ("temperature", [0.0, -1.0]),
                       ("seed", [1, -2]), ("seed", ["a", 1]), ("top_k", np.array([0, -3], np.int32)),
                       ("min_p", [0.0]), ("min_p", [0.0, 1.5]), ("min_p", [-0.1, 0.0])):
        with pytest.raises(ValueError, match="sampling"):
            Worker._sampling(batch(**{**full, field: bad}))


# --- the filters against a float64 reference ----------------------------------------------

def reference(z: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The distribution a sampled row must follow, in float64 over a full stable sort: softmax
    at the temperature, cut to the top k (ties by lower id), then to the smallest prefix whose
    renormalised mass reaches top_p, then to p >= min_p * max p; renormalised."""
    p = np.exp((z - z.max()) / temperature)
    order = np.argsort(-z, kind="stable")
    q = p[order]
    if 0 < top_k < len(z):
        q[top_k:] = 0.0
    before = np.cumsum(q) - q
    q = np.where(before < top_p * q.sum(), q, 0.0)
    q = np.where(q >= min_p * q.max(), q, 0.0)
    out = np.zeros(len(z))
    out[order] = q
    return out / out.sum()


def chi2_pvalue(stat: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > stat): 1 - the regularised lower incomplete
    gamma function P(df/2, stat/2) by its power series (scipy is not a dependency)."""
    a, x = df / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= x / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(x) - x - math.lgamma(a)) * total)


def chi_square(tokens: np.ndarray, want: np.ndarray, bins: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of the draws against `want`, tokens pooled into `bins` (bin id per
    token), bins with fewer than 5 expected draws pooled together; (statistic, df)."""
    n = len(tokens)
    got = np.bincount(bins[tokens], minlength=bins.max() + 1).astype(float)
    exp = np.bincount(bins, weights=want, minlength=bins.max() + 1) * n
    small = exp < 5
    got = np.append(got[~small], got[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    if exp[-1] == 0:
        assert got[-1] == 0
        got, exp = got[:-1], exp[:-1]
    return float(((got - exp) ** 2 / exp).sum()), len(exp) - 1


TWELVE = np.array([2.1, 1.7, 1.7, 1.2, 0.8, 0.3, 0.0, -0.4, -0.9, -1.5, -2.2, -3.0])[
    np.random.default_rng(11).permutation(12)]  # not in id order, with a tie
SETTINGS = [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.7),
            dict(temperature=1.0, top_k=4), dict(temperature=1.3, top_k=3),
            dict(temperature=1.0, top_p=0.7), dict(temperature=0.8, top_p=0.93),
            dict(temperature=1.0, min_p=0.2), dict(temperature=1.5, min_p=0.05),
            dict(temperature=1.0, top_k=6, top_p=0.8), dict(temperature=1.2, top_k=8, top_p=0.9, min_p=0.1),
            dict(temperature=1.0, top_p=0.85, min_p=0.3)]


@pytest.mark.parametrize("case", SETTINGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_draws_pass_a_chi_square_test_against_the_reference(case):
    """20,000 positions of one seed are independent draws; at alpha 1e-6 a correct sampler
    fails about once in a million runs (and the seeds are fixed, so never by chance)."""
    n = 20000
    want = reference(TWELVE, **case)
    tokens, _ = sample(np.broadcast_to(TWELVE, (n, 12)), rows(n, seed=1234, position=np.arange(n), **case))
    assert set(np.flatnonzero(np.bincount(tokens, minlength=12))) <= set(np.flatnonzero(want))
    stat, df = chi_square(tokens, want, np.arange(12))
    assert chi2_pvalue(stat, df) > 1e-6, (case, stat, df, np.bincount(tokens, minlength=12) / n, want)


@pytest.mark.parametrize("case", [dict(temperature=1.0), dict(temperature=0.9, min_p=0.05),
                                  dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, top_k=300)])
def test_draws_over_several_blocks_and_groups_follow_the_reference(case):
    """A vocabulary spanning several walk blocks and top-k groups (and a ragged tail), its
    tokens pooled into 20 bins of neighbouring ids."""
    vocab, n = 3 * sampler.BLOCK + 37, 5000
    z = np.random.default_rng(5).standard_normal(vocab) * 1.5
    want = reference(z, **case)
    tokens, _ = sample(np.broadcast_to(z, (n, vocab)), rows(n, seed=99, position=np.arange(n), **case))
    assert want[tokens].min() > 0
    stat, df = chi_square(tokens, want, np.arange(vocab) * 20 // vocab)
    assert chi2_pvalue(stat, df) > 1e-6, (case, stat, df)


def test_chi_square_rejects_a_wrong_distribution():
    """The test above can fail: draws at temperature 1 do not pass for temperature 1.2."""
    n = 20000
    tokens, _ = sample(np.broadcast_to(TWELVE, (n, 12)), rows(n, seed=1234, position=np.arange(n)))
    stat, df = chi_square(tokens, reference(TWELVE, 1.2), np.arange(12))
    assert chi2_pvalue(stat, df) < 1e-6


MIXED = [dict(), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.3), dict(top_k=40, top_p=0.9, min_p=0.01),
         dict(top_p=0.97), dict(temperature=0.0), dict(top_k=1), dict(temperature=3.0, top_p=0.999)]


def mixed_rows(n: int, seed: int) -> SamplingRows:
    """n rows cycling through MIXED, each with its own seed and position."""
    r = rows(n, seed=seed + np.arange(n), position=1000 + 7 * np.arange(n), logprobs=np.arange(n) % 2 == 0)
    for i in range(n):
        for name, v in MIXED[i % len(MIXED)].items():
            getattr(r, name)[i] = v
    return r


def subset(r: SamplingRows, idx: np.ndarray) -> SamplingRows:
    return SamplingRows(*(getattr(r, f)[idx] for f in ("temperature", "top_p", "top_k", "seed", "position",
                                                       "logprobs", "min_p")))


@pytest.mark.parametrize("vocab", [12, 1000, 5 * sampler.GROUPS * sampler.GROUPS + 3])
def test_every_setting_gives_the_same_token_alone_batched_or_permuted(vocab):
    n = 27
    z = np.random.default_rng(vocab).standard_normal((n, vocab)) * 2.5
    r = mixed_rows(n, seed=77)
    together, lp = sample(z, r)
    alone = [sample(z[i:i + 1], subset(r, [i])) for i in range(n)]
    assert together.tolist() == [int(t[0]) for t, _ in alone] and lp.tolist() == [float(x[0]) for _, x in alone]
    perm = np.random.default_rng(1).permutation(n)
    mixed, lp2 = sample(z[perm], subset(r, perm))
    assert mixed.tolist() == together[perm].tolist() and lp2.tolist() == lp[perm].tolist()
    assert sample(z.astype(np.float32), r)[0].dtype == np.int32  # float32 logits work too


def test_top_p_gives_the_same_token_whatever_candidate_count_it_took(monkeypatch):
    """Top-p alone over flat logits outgrows the first candidates; the tokens equal those of a
    run that starts from every token (the kept set and the draw do not depend on the count)."""
    vocab, n = 700 * sampler.GROUPS + 5, 48  # more groups than the candidates of two tries
    z = np.random.default_rng(3).standard_normal((n, vocab)).astype(np.float32)
    r = rows(n, top_p=np.linspace(0.05, 0.99, n), min_p=np.where(np.arange(n) % 3 == 0, 0.4, 0.0),
             seed=5, position=np.arange(n))
    grown, _ = sample(z, r)
    monkeypatch.setattr(sampler, "NUCLEUS_K", vocab)
    assert grown.tolist() == sample(z, r)[0].tolist()


def test_greedy_ties_survive_float32_and_the_filters():
    """Logits that differ only beyond float32's precision: argmax, top_k 1 and a tiny top_p
    all pick the float64 maximum."""
    z = np.zeros((3, 500))
    z[:, [7, 300]] = 1.0
    z[0, 300] += 1e-12  # the maximum is 300 in float64; in float32 7 and 300 tie
    z[2, :] = 0.25      # all tied: the lowest id
    for limit in (dict(temperature=0.0), dict(top_k=1), dict(top_p=1e-9), dict(top_k=1, top_p=0.5, min_p=1.0)):
        tokens, _ = sample(z, rows(3, seed=3, position=np.arange(3), **limit))
        assert tokens.tolist() == [300, 7, 0], limit


def test_infinite_and_nan_logits():
    """+inf tokens take all the mass; NaN and -inf tokens none; a row with nothing finite falls
    back to argmax like a greedy row."""
    z = np.zeros((4, 100))
    z[0, [3, 50]] = np.inf
    z[1, ::2] = np.nan
    z[2, :] = -np.inf
    z[2, 40] = 1.0
    z[3, :] = -np.inf
    for extra in (dict(), dict(top_k=10), dict(top_p=0.5), dict(min_p=0.1)):
        for s in range(20):
            tokens, _ = sample(z, rows(4, seed=s, position=np.arange(4), **extra))
            assert tokens[0] in (3, 50) and tokens[1] % 2 == 1 and tokens[2] == 40 and tokens[3] == 0, extra


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    vocab = draw(st.sampled_from([1, 2, 12, 63, 64, 130, 300]))
    coarse = draw(st.booleans())  # few distinct values: ties everywhere
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    z = np.round(rng.standard_normal((n, vocab)) * 2) if coarse else rng.standard_normal((n, vocab)) * 4
    holes = rng.random((n, vocab)) < draw(st.sampled_from([0.0, 0.3, 0.9]))
    z[holes] = rng.choice([-np.inf, np.nan], size=int(holes.sum()))
    z[np.arange(n), rng.integers(0, vocab, n)] = rng.standard_normal(n)  # one finite logit at least
    r = rows(n, temperature=rng.choice([0.0, 0.3, 1.0, 2.0], n), top_k=rng.choice([0, 1, 2, 5, 100], n),
             top_p=rng.choice([1.0, 0.999, 0.9, 0.5, 0.01], n), min_p=rng.choice([0.0, 0.05, 0.5, 1.0], n),
             seed=rng.integers(0, 2**63, n, dtype=np.uint64), position=rng.integers(0, 10**6, n))
    return z, r


def allowed(z: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> set:
    """Tokens the filters may keep: top-k exactly (ties by lower id); top-p and min-p with a
    little slack, for float32 rounding at their boundaries."""
    z = np.where(np.isnan(z), -np.inf, z)
    order = np.argsort(-z, kind="stable")
    if 0 < top_k < len(z):
        order = order[:top_k]
    p = np.exp((z[order] - z.max()) / temperature)
    more_likely = np.array([p[p > x].sum() for x in p])
    keep = (more_likely < (top_p + 1e-5) * p.sum()) & (p >= min_p * (1 - 1e-5)) & (p > 0)
    return set(order[keep].tolist())


@settings(max_examples=150, deadline=None)
@given(batches())
def test_the_chosen_token_is_always_one_the_filters_keep(batch):
    z, r = batch
    tokens, _ = sample(z, r)
    for i, t in enumerate(tokens):
        if r.temperature[i] == 0:
            assert t == np.argmax(z[i])
        else:
            assert np.isfinite(z[i, t])
            assert t in allowed(z[i], r.temperature[i], r.top_k[i], r.top_p[i], r.min_p[i])
            if r.top_k[i] == 1:
                assert t == np.argmax(np.where(np.isnan(z[i]), -np.inf, z[i]))


# ---- top logprobs, logit bias, penalties ------------------------------------------------------

def test_top_logprobs_are_the_largest_of_a_float64_log_softmax_ties_by_lower_id():
    z = logits(5, seed=11)
    z[2, [7, 3, 40]] = 9.0  # a tie at the top: ids in ascending order
    r = rows(5, temperature=0.0)
    r.top_logprobs = np.array([0, 1, 3, 20, 64])
    ids, lps = sampler.top_logprobs(z, r)
    ref = log_softmax(z)
    assert ids.shape == (5, 64) and not ids[0].any()
    for i, k in enumerate(r.top_logprobs):
        want = np.lexsort((np.arange(VOCAB), -ref[i]))[:k]  # by logprob, ties by id
        assert ids[i, :k].tolist() == want.tolist()
        np.testing.assert_allclose(lps[i, :k], ref[i, want], atol=1e-5)
    assert ids[2, :3].tolist() == [3, 7, 40]


def test_bias_and_penalties_match_a_hand_computed_expectation():
    z = np.array([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                  [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    r = rows(2, temperature=0.0, logprobs=True)
    r.bias_lens, r.bias_ids, r.bias_vals = np.array([2, 0]), np.array([3, 4]), np.array([-np.inf, 5.0])
    r.repetition, r.presence, r.frequency = np.array([1.0, 2.0]), np.array([0.0, 0.5]), np.array([0.0, 0.25])
    # row 1: token 0 twice in the output, 1 once, 5 only in the prompt
    r.pen_lens, r.pen_ids, r.pen_counts = np.array([0, 3]), np.array([0, 1, 5]), np.array([2, 1, 0])
    want = z.copy()
    want[0, 3], want[0, 4] = -np.inf, 3.0
    want[1, 0] = 2.0 / 2 - 0.25 * 2 - 0.5     # positive: divided, then frequency and presence
    want[1, 1] = -1.0 * 2 - 0.25 - 0.5        # negative: multiplied
    want[1, 5] = 1.0 / 2                      # in the prompt only: repetition alone
    np.testing.assert_array_equal(sampler.adjust(z, r), want)
    tokens, lps = sample(z, r)
    assert tokens.tolist() == want.argmax(axis=-1).tolist() == [4, 3]
    np.testing.assert_allclose(lps, log_softmax(z)[[0, 1], [4, 3]], atol=1e-6)  # the model's own logits
    assert sampler.adjust(z, rows(2)) is z  # nothing asked: no copy


def test_a_banned_token_is_never_drawn_and_a_bias_moves_the_distribution():
    z = np.array([2.0, 1.0, 0.5, 0.0])
    n = 20000
    r = rows(n, seed=3, position=np.arange(n))
    r.bias_lens = np.ones(n, np.int64) * 2
    r.bias_ids = np.tile([0, 3], n)
    r.bias_vals = np.tile([-np.inf, 2.0], n)
    tokens, _ = sample(np.broadcast_to(z, (n, 4)), r)
    freq = np.bincount(tokens, minlength=4) / n
    want = np.exp([-np.inf, 1.0, 0.5, 2.0]) / np.exp([-np.inf, 1.0, 0.5, 2.0]).sum()
    assert freq[0] == 0 and np.abs(freq - want).max() < 0.015, (freq, want)


def test_the_worker_reads_the_adjustments_or_refuses_them():
    from kvrt.ipc import protocol as P
    from kvrt.workers.worker import Worker

    def batch(**kw):
        b = P.StepBatch(1, np.array([1, 2], np.int32), np.array([1, 1], np.int32), np.array([0, 0], np.int32),
                        np.array([0, 1], np.int32), np.array([1, 1], np.int32), temperature=[0.0, 1.0],
                        top_p=[1.0, 1.0], top_k=np.zeros(2, np.int32), seed=[1, 2], logprobs=np.zeros(2, np.int32))
        for k, v in kw.items():
            setattr(b, k, v)
        return b

    r = Worker._sampling(batch(top_logprobs=np.array([0, 5], np.int32), bias_lens=np.array([1, 0], np.int32),
                               bias_ids=np.array([9], np.int32), bias_vals=[-1.5], repetition=[1.0, 1.2],
                               presence=[0.0, 0.1], frequency=[0.0, 0.2], pen_lens=np.array([0, 2], np.int32),
                               pen_ids=np.array([4, 6], np.int32), pen_counts=np.array([1, 0], np.int32)))
    assert r.top_logprobs.tolist() == [0, 5] and r.bias_vals.tolist() == [-1.5] and r.pen_ids.tolist() == [4, 6]
    assert Worker._sampling(batch()).bias_lens is None
    for bad in (dict(bias_lens=np.array([2, 0], np.int32), bias_ids=np.array([9, 9], np.int32), bias_vals=[1.0, 2.0]),
                dict(bias_lens=np.array([1, 0], np.int32), bias_ids=np.array([9], np.int32), bias_vals=[]),
                dict(top_logprobs=np.array([1], np.int32)),
                dict(repetition=[1.0, 1.0], presence=[0.0, 0.0], frequency=[0.0, 0.0]),
                dict(repetition=[0.0, 1.0], presence=[0.0, 0.0], frequency=[0.0, 0.0],
                     pen_lens=np.zeros(2, np.int32))):
        with pytest.raises(ValueError):
            Worker._sampling(batch(**bad))
