"""Choosing the next token from a step's logits: greedy, or sampled with temperature, top-k,
top-p and min-p, one row per sequence, at a small cost next to the model step that made them.

Why the random draw is a function of (seed, position) only: a request's tokens must not
depend on what else shares its step (batch composition, preemption and recompute, a prefill
node sampling the first token and a decode node the rest). Each row takes one uniform number,
a hash of its request's seed and the position of the token it samples, and turns it into a
token by inverting the row's (truncated) cumulative distribution, so the same logits,
parameters, seed and position always give the same token.

Why nothing sorts the vocabulary: a vocabulary is ~10^5 tokens and a sort of each row costs
more than the decode step itself. Without top-k and top-p, the draw walks the softmax in token
order in two levels (sums of fixed blocks, then one block), so a row costs a few passes over
its logits. With them, only the tokens that can be kept are sorted: a threshold from the
maxima of fixed token groups (the K-th largest group maximum has at least K tokens at or above
it) picks a candidate set barely larger than K, and top-p without top-k grows K until the
nucleus ends inside the candidates (the full sort only when it never does).

Greedy rows (temperature 0, or below GREEDY_BELOW) are exactly argmax, as before sampling
existed, so the exactness checks against the dense reference hold unchanged. Sorted orders break ties by the lower token
id, as argmax does, so top_k 1 and a tiny top_p are exactly greedy; candidates are chosen and
ordered on the logits as they come (no rounding to float32 first, which could create ties).

Why penalties and logit biases travel as (row, token) entries: a request's adjustments touch
the few tokens it names or has seen, so each is one gather and one scatter over those entries
for the whole batch (no pass over the vocabulary, no loop over rows), and the engine recomputes
them from the request's tokens each step, so they stay right across preemption and P/D. The
adjusted logits feed the draw and greedy's argmax; logprobs stay those of the model's own logits.

Why guided decoding is a mask in `adjust`: a grammar allows a set of next tokens, and a token
outside it must never be chosen, by greedy's argmax or by any draw. The engine sends each guided
row's set as packed bits; they are unpacked on the device the logits are on and every other
token's logit becomes -inf after the biases and penalties, before temperature, top-k, top-p and
min-p, so every path after it only ever sees allowed tokens. A row whose allowed tokens all came
out -inf (a bias banned them) draws among them as if uniform instead: still inside the grammar.

The same code runs on numpy or cupy (`xp`); results come back as host numpy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

BLOCK = 256      # tokens per block of the two-level inverse-CDF walk
GROUPS = 64      # tokens per group whose maxima bound the top-k threshold
NUCLEUS_K = 64   # first candidate count for top-p without top-k; grows 8x while too small
CHUNK = 8        # rows at a time on a CPU, so a chunk's float32 scratch stays in cache
# below this temperature a row is greedy: the limit of softmax(z / t) as t -> 0 is the argmax,
# and dividing float32 logits by a smaller t overflows (a draw from inf / nan picked token 0)
GREEDY_BELOW = 1e-5


@dataclass
class SamplingRows:
    """Per-row sampling parameters of one step (host arrays, one entry per sequence).

    temperature 0 (or below GREEDY_BELOW) is greedy; top_k 0 (or >= vocab) keeps every token; top_p 1 keeps every
    token; min_p 0 keeps every token (else those with p >= min_p * max p); position is the
    index the sampled token will have in its sequence. The kept set is top-k's, cut by top-p
    over the top-k tokens' renormalised probabilities, cut by min-p.

    Adjustments before the draw (None: none for any row): first `bias_vals` is added to the
    logits of `bias_ids` (bias_lens[i] entries for row i, each token once per row; -inf bans a
    token); then the tokens `pen_ids` (pen_lens[i] for row i) with output counts `pen_counts`
    get HF's repetition penalty (logit / r if positive, else * r: every listed token, so a
    row lists its prompt's tokens too when r != 1) and OpenAI's frequency and presence
    penalties (- f * count - p * (count > 0)). Then the guided rows `allowed_rows` keep only
    the tokens set in their `allowed` bits (see the module docstring). `top_logprobs[i]`
    alternatives are answered by `top_logprobs()`."""

    temperature: np.ndarray  # float64
    top_p: np.ndarray        # float64
    top_k: np.ndarray        # int64
    seed: np.ndarray         # uint64
    position: np.ndarray     # int64
    logprobs: np.ndarray     # bool: also return the log-probability of the chosen token
    min_p: np.ndarray = field(default=None)  # float64; None: 0 (off) for every row
    top_logprobs: np.ndarray | None = None   # int64 [n]; None: 0 for every row
    bias_lens: np.ndarray | None = None      # int64 [n]
    bias_ids: np.ndarray | None = None       # int64 [sum(bias_lens)]
    bias_vals: np.ndarray | None = None      # float64 [sum(bias_lens)]
    repetition: np.ndarray | None = None     # float64 [n] (1: off), with presence and frequency
    presence: np.ndarray | None = None       # float64 [n] (0: off)
    frequency: np.ndarray | None = None      # float64 [n] (0: off)
    pen_lens: np.ndarray | None = None       # int64 [n]
    pen_ids: np.ndarray | None = None        # int64 [sum(pen_lens)]
    pen_counts: np.ndarray | None = None     # int64 [sum(pen_lens)]: each token's count in the output
    allowed_rows: np.ndarray | None = None   # int64 [g]: the guided rows
    allowed: np.ndarray | None = None        # int32 [g, words]: their allowed tokens, bit t % 32 of word t // 32

    def __post_init__(self) -> None:
        if self.min_p is None:
            self.min_p = np.zeros(len(self.temperature))

    @classmethod
    def greedy(cls, n: int) -> "SamplingRows":
        """n greedy rows without logprobs (what a step without sampling parameters means)."""
        return cls(np.zeros(n), np.ones(n), np.zeros(n, np.int64), np.zeros(n, np.uint64),
                   np.zeros(n, np.int64), np.zeros(n, bool), np.zeros(n))


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
    tokens = np.zeros(n, np.int32)
    z = adjust(logits, rows, xp)
    hot = np.flatnonzero(rows.temperature >= GREEDY_BELOW)
    cold = np.flatnonzero(~(rows.temperature >= GREEDY_BELOW))
    if len(cold):
        tokens[cold] = _host(_take(z, cold, xp).argmax(axis=-1))
    if len(hot):
        tokens[hot] = _draw(_take(z, hot, xp), rows, hot, xp)
    logprobs = np.zeros(n)
    want = np.flatnonzero(rows.logprobs)
    if len(want):
        logprobs[want] = _logprobs(_take(logits, want, xp), tokens[want], xp)
    return tokens, logprobs


def adjust(logits: Any, rows: SamplingRows, xp: Any = np) -> Any:
    """The logits the draw sees: `logits` itself without adjustments, else a copy with the
    rows' biases, then penalties, then guided masks applied (see SamplingRows), one scatter each."""
    n = int(logits.shape[0])
    bias = rows.bias_lens is not None and int(np.sum(rows.bias_lens)) > 0
    pen = rows.pen_lens is not None and int(np.sum(rows.pen_lens)) > 0
    guided = rows.allowed_rows is not None and len(rows.allowed_rows) > 0
    if not (bias or pen or guided):
        return logits
    z = logits.copy()
    ft = xp.float64 if z.dtype == xp.float64 else xp.float32  # the arithmetic: at least float32
    if bias:
        r = xp.asarray(np.repeat(np.arange(n), rows.bias_lens))
        ids = xp.asarray(np.asarray(rows.bias_ids, np.int64))
        z[r, ids] = (z[r, ids].astype(ft) + xp.asarray(rows.bias_vals, ft)).astype(z.dtype)
    if pen:
        hr = np.repeat(np.arange(n), rows.pen_lens)
        r, ids = xp.asarray(hr), xp.asarray(np.asarray(rows.pen_ids, np.int64))
        counts = np.asarray(rows.pen_counts, np.float64)
        v = z[r, ids].astype(ft)
        rep = xp.asarray(rows.repetition[hr], ft)
        v = xp.where(v > 0, v / rep, v * rep)
        v -= xp.asarray(rows.frequency[hr] * counts + rows.presence[hr] * (counts > 0), ft)
        z[r, ids] = v.astype(z.dtype)
    if guided:
        _mask(z, rows.allowed_rows, rows.allowed, xp)
    return z


def _mask(z: Any, rows: np.ndarray, allowed: np.ndarray, xp: Any) -> None:
    """Guided rows of z (in place) keep their allowed tokens' logits, -inf elsewhere; a row
    whose allowed logits are all -inf or NaN becomes 0 on every allowed token (see the module
    docstring). On a CPU a chunk of rows at a time, with one scratch for all, so that what it
    touches stays in cache and no chunk faults fresh pages in."""
    n, vocab = z.shape
    rows = np.asarray(rows, np.int64)
    step = CHUNK if xp is np else max(len(rows), 1)
    scratch = xp.empty((2, min(step, len(rows)), vocab), xp.int32) if z.dtype == xp.float32 else None
    for at in range(0, len(rows), step):
        part = rows[at:at + step]
        run = bool(np.all(part == np.arange(part[0], part[0] + len(part))))
        r = None if run else xp.asarray(part)
        sub = z[int(part[0]):int(part[0]) + len(part)] if run else z[r]  # consecutive rows: a view
        banned = unpack_mask(~xp.asarray(allowed[at:at + step]), vocab, xp)
        _ban(sub, banned, xp, scratch)
        dead = ~(sub.max(axis=-1) > -xp.inf)  # (a NaN maximum counts as dead too)
        if bool(dead.any()):  # (one value: a host bool on cupy too)
            sub[dead] = xp.where(banned[dead], xp.asarray(-xp.inf, z.dtype), xp.asarray(0, z.dtype))
        if not run:
            z[r] = sub


_NEG_INF_BITS = int(np.float32(-np.inf).view(np.int32))


def _ban(a: Any, banned: Any, xp: Any, scratch: Any) -> None:
    """a[banned] = -inf, in place. Float32 rows by bit operations on their int32 view, a blend
    with -inf's bits through an all-ones mask (a masked store branches at every token of a
    random mask: ten times slower at 151k tokens here), in `scratch` ([2, >= rows, vocab] int32)."""
    if scratch is None or not a.flags.c_contiguous:
        a[...] = xp.where(banned, xp.asarray(-xp.inf, a.dtype), a)
        return
    m, tmp = scratch[0, :a.shape[0]], scratch[1, :a.shape[0]]
    m[...] = banned.view(xp.int8)
    xp.negative(m, out=m)  # banned: every bit set
    bits = a.view(xp.int32)
    xp.bitwise_xor(bits, _NEG_INF_BITS, out=tmp)
    xp.bitwise_and(tmp, m, out=tmp)
    xp.bitwise_xor(bits, tmp, out=bits)  # banned: -inf's bits; else its own


def unpack_mask(words: Any, vocab: int, xp: Any = np) -> Any:
    """bool [g, vocab] from packed int32 words [g, W] (token t: bit t % 32 of word t // 32):
    numpy unpacks the little-endian bytes; cupy shifts each token's word."""
    if xp is np:
        b = np.ascontiguousarray(words, dtype="<i4").view(np.uint8)
        return np.unpackbits(b, axis=-1, count=vocab, bitorder="little").astype(bool)
    return shift_unpack(words, vocab, xp)


def shift_unpack(words: Any, vocab: int, xp: Any) -> Any:
    """`unpack_mask` by a gather and a shift per token, for an array module without unpackbits
    along an axis."""
    t = xp.arange(vocab)
    return ((words[:, t // 32] >> (t % 32).astype(xp.int32)) & 1).astype(bool)


def top_logprobs(logits: Any, rows: SamplingRows, xp: Any = np) -> tuple[np.ndarray, np.ndarray]:
    """The `rows.top_logprobs[i]` most likely tokens of each row under the model's unscaled
    logits and their log-probabilities, most likely first (ties by the lower id): host int32
    ids and float64 logprobs [n, K], K the largest count asked (rows that asked fewer: their
    first entries). Candidates as the top-k draw finds them (a threshold from group maxima, so
    barely more than K per row), sorted; no pass sorts the vocabulary."""
    n = int(logits.shape[0])
    ks = np.zeros(n, np.int64) if rows.top_logprobs is None else np.asarray(rows.top_logprobs, np.int64)
    k = int(ks.max()) if n else 0
    if k <= 0:
        return np.zeros((n, 0), np.int32), np.zeros((n, 0))
    want = np.flatnonzero(ks > 0)
    z = _take(logits, want, xp)
    k = min(k, int(z.shape[1]))
    if not np.isfinite(_host(z.max(axis=-1))).all():
        z = xp.where(xp.isnan(z), -xp.inf, z)
    t = _threshold(z, _group_maxima(z, xp), np.full(len(want), k), xp)
    cand, vals, _ = _candidates(z, t, xp)  # sorted, ties by the lower id; at least k per row
    ids = cand[:, :k]
    lps = vals[:, :k].astype(xp.float32) - _logsumexp(z, xp)[:, None]
    out_ids, out_lps = np.zeros((n, k), np.int32), np.zeros((n, k))
    out_ids[want], out_lps[want] = _host(ids), _host(lps)
    return out_ids, out_lps


def _logsumexp(z: Any, xp: Any) -> Any:
    """log sum exp of each row of z, in float32 around the row maximum."""
    zmax = z.max(axis=-1)
    e = xp.empty(z.shape, xp.float32)
    xp.subtract(z, zmax[:, None], out=e, casting="same_kind")
    return xp.log(xp.exp(e, out=e).sum(axis=-1)) + zmax.astype(xp.float32)


def _draw(z: Any, rows: SamplingRows, idx: np.ndarray, xp: Any) -> np.ndarray:
    """Sampled tokens of the rows `idx` of `rows`, whose logits are z [len(idx), vocab]."""
    m, vocab = z.shape
    tokens = np.zeros(m, np.int32)
    zmax = z.max(axis=-1)
    host_max = _host(zmax)
    if not np.isfinite(host_max).all():
        z, zmax, host_max = _finite_rows(z, host_max, xp)
    live = host_max > -np.inf  # a row of -inf and NaN only has nothing to draw: argmax, as greedy
    if not live.all():
        tokens[~live] = _host(_take(z, np.flatnonzero(~live), xp).argmax(axis=-1))
    inv_t = 1.0 / rows.temperature[idx]
    k = rows.top_k[idx].astype(np.int64)
    k = np.where((k > 0) & (k < vocab), k, 0)
    top_p, min_p = rows.top_p[idx].astype(np.float64), rows.min_p[idx].astype(np.float64)
    u = uniforms(rows.seed[idx], rows.position[idx])
    cut = (k > 0) | (top_p < 1)
    for sel, fn in ((live & ~cut, _walk), (live & cut, _nucleus)):
        every = np.flatnonzero(sel)
        for s in np.split(every, range(CHUNK, len(every), CHUNK)) if xp is np else [every]:
            if len(s):
                zs = _take(z, s, xp)
                zm = zmax if len(s) == m else zmax[xp.asarray(s)]
                tokens[s] = fn(zs, zm, inv_t[s], k[s], top_p[s], min_p[s], u[s], xp)
    return tokens


def _finite_rows(z: Any, host_max: np.ndarray, xp: Any) -> tuple[Any, Any, np.ndarray]:
    """z with NaN logits made -inf, and rows holding +inf made uniform over their +inf tokens
    (what the limit of a huge logit means); its row maxima again."""
    z = xp.where(xp.isnan(z), -xp.inf, z)
    inf_rows = xp.asarray(host_max == np.inf)[:, None]
    z = xp.where(inf_rows, xp.where(z == xp.inf, 0.0, -xp.inf).astype(z.dtype), z)
    zmax = z.max(axis=-1)
    return z, zmax, _host(zmax)


def _probs(z: Any, zmax: Any, inv_t: np.ndarray, xp: Any) -> Any:
    """exp((z - max) / temperature) in float32 [m, vocab]: the unnormalised softmax, 1 at
    the maximum."""
    p = xp.empty(z.shape, xp.float32)
    xp.subtract(z, zmax[:, None], out=p, casting="same_kind")
    if (inv_t != 1).any():
        p *= xp.asarray(inv_t, xp.float32)[:, None]
    return xp.exp(p, out=p)


def _walk(z: Any, zmax: Any, inv_t: np.ndarray, k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
          u: np.ndarray, xp: Any) -> np.ndarray:
    """Inverse CDF over the whole softmax (min-p applied) in token order, in two levels so
    that no cumulative sum runs over the vocabulary: block sums, then one block."""
    p = _probs(z, zmax, inv_t, xp)
    if (min_p > 0).any():
        p *= p >= xp.asarray(min_p, xp.float32)[:, None]
    m, vocab = p.shape
    full = vocab // BLOCK * BLOCK
    sums = [p[:, :full].reshape(m, -1, BLOCK).sum(axis=-1)] if full else []
    if full < vocab:
        sums.append(p[:, full:].sum(axis=-1, keepdims=True))
    s = xp.concatenate(sums, axis=-1).astype(xp.float64) if len(sums) > 1 else sums[0].astype(xp.float64)
    b, rem = _invert(s, xp.asarray(u), xp)
    cols = b[:, None] * BLOCK + xp.arange(BLOCK)[None, :]
    inside = cols < vocab
    vals = xp.take_along_axis(p, xp.minimum(cols, vocab - 1), axis=-1).astype(xp.float64) * inside
    j = _pick(vals, rem, xp)
    return _host(b * BLOCK + j).astype(np.int32)


def _invert(s: Any, u: Any, xp: Any) -> tuple[Any, Any]:
    """For masses s [m, n] (float64, some positive in each row) and uniforms u [m]: the index
    whose cumulative interval holds u * total, and how far into it u * total lies. The index
    always has positive mass, whatever the rounding."""
    cs = xp.cumsum(s, axis=-1)
    target = u * cs[:, -1]
    i = xp.minimum((cs <= target[:, None]).sum(axis=-1), _last_positive(s, xp))
    before = xp.take_along_axis(cs, xp.maximum(i - 1, 0)[:, None], axis=-1)[:, 0]
    return i, target - xp.where(i > 0, before, 0.0)


def _pick(vals: Any, rem: Any, xp: Any) -> Any:
    """The index in each row of vals [m, n] (float64) where the running sum passes rem [m]
    (the last positive one if rounding leaves it short)."""
    inner = xp.cumsum(vals, axis=-1)
    return xp.minimum((inner <= rem[:, None]).sum(axis=-1), _last_positive(vals, xp))


def _last_positive(a: Any, xp: Any) -> Any:
    n = a.shape[-1]
    return n - 1 - xp.argmax(a[:, ::-1] > 0, axis=-1)


def _nucleus(z: Any, zmax: Any, inv_t: np.ndarray, k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
             u: np.ndarray, xp: Any) -> np.ndarray:
    """Top-k, top-p and min-p over a sorted candidate set that holds every kept token: k
    candidates for top-k; for top-p alone, a set grown until the nucleus ends inside it. The
    normaliser of top-p alone is the whole softmax's (float32), whatever the candidate count,
    so the kept set does not depend on how many candidates it took."""
    m, vocab = z.shape
    norm = np.full(m, np.nan)  # top-p alone: the softmax's sum; with top-k: the k kept tokens'
    alone = np.flatnonzero(k == 0)
    if len(alone):
        norm[alone] = _host(_probs(_take(z, alone, xp), zmax[xp.asarray(alone)] if len(alone) < m else zmax,
                                   inv_t[alone], xp).sum(axis=-1)).astype(np.float64)
    want = np.where(k > 0, k, NUCLEUS_K)
    tokens = np.zeros(m, np.int32)
    todo = np.arange(m)
    groups = _group_maxima(z, xp)
    while len(todo):
        sub = lambda a: a if len(todo) == m else a[xp.asarray(todo)]  # noqa: E731
        done, grow, got = _nucleus_once(sub(z), sub(zmax), sub(groups), inv_t[todo], k[todo], top_p[todo],
                                        min_p[todo], norm[todo], u[todo], want[todo], xp)
        tokens[todo[done]] = got[done]
        todo = todo[grow]  # rows whose nucleus did not end inside their candidates
        want[todo] *= 8
    return tokens


def _nucleus_once(z: Any, zmax: Any, groups: Any, inv_t: np.ndarray, k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray, norm: np.ndarray, u: np.ndarray, want: np.ndarray,
                  xp: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One try with `want` candidates per row: (rows drawn, rows needing more, tokens)."""
    t = _threshold(z, groups, want, xp)
    cand, vals, counts = _candidates(z, t, xp)
    c = cand.shape[1]
    q = xp.exp((vals.astype(xp.float64) - zmax[:, None].astype(xp.float64)) * xp.asarray(inv_t)[:, None])
    rank = xp.arange(c)[None, :]
    kk = xp.asarray(np.where(k > 0, k, c + 1))[:, None]
    q = q * (rank < kk)
    cq = xp.cumsum(q, axis=-1)
    with_k = k > 0
    last_k = xp.asarray(np.minimum(np.where(with_k, k, 1), _host(counts)) - 1)
    n = xp.where(xp.asarray(with_k), xp.take_along_axis(cq, last_k[:, None], axis=-1)[:, 0],
                 xp.asarray(np.nan_to_num(norm)))
    keep = (cq - q < xp.asarray(top_p)[:, None] * n[:, None]) & (q >= xp.asarray(min_p)[:, None])
    kept = q * keep
    j = _pick(kept, xp.asarray(u) * xp.cumsum(kept, axis=-1)[:, -1], xp)
    got = _host(xp.take_along_axis(cand, j[:, None], axis=-1)[:, 0]).astype(np.int32)
    # a row needs more candidates when the token after its last could still be kept: its
    # mass before that token is under top_p, and that token (at most the threshold's p) passes
    # min-p and has mass
    total = _host(xp.take_along_axis(cq, (counts - 1)[:, None], axis=-1)[:, 0])
    qt = np.exp((_host(t).astype(np.float64) - _host(zmax).astype(np.float64)) * inv_t)
    grow = ~with_k & np.isfinite(_host(t)) & (total < top_p * norm) & (qt >= min_p) & (qt > 0)
    return np.flatnonzero(~grow), np.flatnonzero(grow), got


def _group_maxima(z: Any, xp: Any) -> Any:
    """The maxima of GROUPS-token groups of each row ([m, vocab // GROUPS]; strided groups, so
    the reduction runs across contiguous rows)."""
    m, vocab = z.shape
    n = vocab // GROUPS
    return z[:, :n * GROUPS].reshape(m, GROUPS, n).max(axis=1)


def _threshold(z: Any, groups: Any, want: np.ndarray, xp: Any) -> Any:
    """Per row, a logit with at least want[i] tokens at or above it: the want-th largest group
    maximum; past the group count, the want-th largest logit (a partial selection over the
    row); -inf (every token) past the vocabulary."""
    m, n = groups.shape
    vocab = z.shape[1]
    t = xp.full(m, -xp.inf, dtype=z.dtype)
    for w in np.unique(want):
        rows = np.flatnonzero(want == w)
        src, size = (groups, n) if w <= n else (z, vocab)
        if w < vocab:
            a = src if len(rows) == m else src[xp.asarray(rows)]
            t[xp.asarray(rows)] = xp.partition(a, size - int(w), axis=-1)[:, size - int(w)]
    return t


def _candidates(z: Any, t: Any, xp: Any) -> tuple[Any, Any, Any]:
    """The tokens at or above each row's threshold, sorted by logit (descending; ties by the
    lower id), padded to one width: (ids [m, c] int64, -1 as padding; logits [m, c], -inf as
    padding; counts [m])."""
    m, vocab = z.shape
    mask = z >= t[:, None]
    flat = xp.flatnonzero(mask)
    counts = mask.sum(axis=-1)
    row, col = flat // vocab, flat % vocab
    start = xp.cumsum(counts) - counts
    at = xp.arange(len(flat)) - start[row]
    c = int(_host(counts).max())
    ids = xp.full((m, c), -1, dtype=xp.int64)
    vals = xp.full((m, c), -xp.inf, dtype=z.dtype)
    ids[row, at] = col
    vals[row, at] = z[row, col]
    order = xp.argsort(-vals, axis=-1, kind="stable") if xp is np else xp.argsort(-vals, axis=-1)
    return xp.take_along_axis(ids, order, axis=-1), xp.take_along_axis(vals, order, axis=-1), counts


def _logprobs(z: Any, tokens: np.ndarray, xp: Any) -> np.ndarray:
    """log softmax(z)[token] per row, the log-sum-exp in float32 around the row maximum."""
    chosen = z[xp.arange(len(tokens)), xp.asarray(tokens.astype(np.int64))]
    return _host(chosen.astype(xp.float32) - _logsumexp(z, xp)).astype(np.float64)


def _take(a: Any, idx: np.ndarray, xp: Any) -> Any:
    """Rows idx of a, without a copy when they are all of them (in order)."""
    return a if len(idx) == a.shape[0] else a[xp.asarray(idx)]


def _host(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()
