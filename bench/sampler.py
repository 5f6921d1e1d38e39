"""`kvrt bench sampler`: what choosing the next token costs next to the greedy argmax.

In one run, on the same logits ([batch, vocab] float32, the vocabulary of Qwen2-class models by
default), for each batch size and each sampling setting:
- `kvrt`: workers/model/sampler.py's `sample` (temperature 0 is the greedy row: argmax);
- `naive`: the sampler kvrt had before, kept here as the baseline a straightforward
  implementation gives: every sampled row sorted whole (stably, in float64), then temperature,
  top-k, top-p and one inverse-CDF draw over the sorted row;
- `torch`: softmax + `torch.multinomial`, with top-k and top-p by a sorted cumulative sum (as
  Hugging Face's logits warpers do), when torch imports (else `-`);
- the `pen` cases add a logit bias and repetition, frequency and presence penalties over a
  2048-token prompt and 256 output tokens per row (`naive` and `torch` get the same
  adjustments, a row at a time for `naive`, kvrt's for `torch`); `top20` adds 20 alternatives'
  logprobs per row (`naive` and `torch`: without them);
- `limit`: one read of the logits at the memory bandwidth measured in this run (the best of a
  few whole-array reductions over 256 MiB): no sampler can take less.

Guided decoding, after the table: the same greedy and t=1 steps with every row guided (a
packed allowed-token mask per row, half the vocabulary allowed, unpacked and applied in the
sampler) next to the unmasked step, as a ratio; what the engine pays per guided row and token
to move its grammar state and write the next mask; and the time to compile a typical JSON
schema, and JSON mode, against a synthetic byte-level vocabulary of the same size (all 256
bytes, then random 2 to 8 character pieces of JSON-ish text: no tokenizer is downloaded).
`--no-guided` leaves that part out.

Ratios are over the greedy argmax of the same batch (what a sampled decode step pays on top of
a greedy one is the ratio minus 1, times the argmax's time). The logits are synthetic and
`peaked` as a language model's usually are (a N(0, 2^2) bulk, 20 tokens 12 to 22 above it, so
a top-p 0.9 nucleus holds a few tokens), or `flat` (the bulk only: the nucleus holds most of
the vocabulary, the worst case for top-p without top-k).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from kvrt.bench.timing import best_seconds
from kvrt.runtime.engine.grammars import Grammars
from kvrt.runtime.grammar.messages import Setup
from kvrt.runtime.engine.guide import GuideState, mask_words
from kvrt.workers.model.sampler import SamplingRows, adjust, sample, top_logprobs, uniforms

CASES = {  # name -> (logits, SamplingRows fields)
    "greedy": ("peaked", dict(temperature=0.0)),
    "t1": ("peaked", dict(temperature=1.0)),
    "t1 p0.9 k50": ("peaked", dict(temperature=1.0, top_p=0.9, top_k=50)),
    "p0.9": ("peaked", dict(temperature=1.0, top_p=0.9)),
    "p0.9 flat": ("flat", dict(temperature=1.0, top_p=0.9)),
    # penalties over a 2048-token prompt and 256 output tokens per row, and a logit bias on 16
    "greedy pen": ("peaked", dict(temperature=0.0, penalties=True)),
    "t1 pen": ("peaked", dict(temperature=1.0, penalties=True)),
    "t1 top20": ("peaked", dict(temperature=1.0, logprobs=True, top_logprobs=20)),
}
PROMPT_TOKENS, OUTPUT_TOKENS, BIASED = 2048, 256, 16
GUIDED_CASES = ("greedy", "t1")
GUIDED_DENSITY = 0.5  # the share of the vocabulary a guided row allows (inside a JSON string: most)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "ok": {"type": "boolean"}}, "required": ["name", "age"]}
PIECE_ALPHABET = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.:;\"'{}[]_-\n"
BANDWIDTH_BYTES = 256 << 20


@dataclass
class Row:
    batch: int
    case: str
    kvrt_ms: float
    naive_ms: float | None
    torch_ms: float | None
    limit_ms: float
    greedy_ms: float
    kvrt_vs_greedy: float
    naive_vs_greedy: float | None
    torch_vs_greedy: float | None
    nucleus_tokens: float | None  # mean tokens in the top-p nucleus (top-p cases)


def best_ms(fn: Callable[[], Any], repeat: int, warm: bool = True) -> float:
    """Best of `repeat` timed calls in ms."""
    return best_seconds(fn, repeat, warm) * 1e3


def bandwidth_gb_s(repeat: int) -> float:
    """Read bandwidth of this machine's memory: the best whole-array reduction over an array
    far larger than any cache."""
    a = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    return max(BANDWIDTH_BYTES / best_ms(f, repeat) / 1e6 for f in (a.sum, a.max))


def logits(kind: str, batch: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    z = (rng.standard_normal((batch, vocab)) * 2).astype(np.float32)
    if kind == "peaked":
        top = min(20, vocab)
        for i in range(batch):
            z[i, rng.choice(vocab, top, replace=False)] += np.linspace(22, 12, top, dtype=np.float32)
    return z


def rows_for(batch: int, fields: dict, vocab: int, rng: np.random.Generator) -> SamplingRows:
    r = SamplingRows.greedy(batch)
    for name, v in fields.items():
        if name == "penalties":
            _penalties(r, vocab, rng)
        elif name == "top_logprobs":
            r.top_logprobs = np.full(batch, v, np.int64)
        else:
            getattr(r, name)[:] = v
    r.seed[:] = np.arange(batch, dtype=np.uint64) * 7919
    r.position[:] = 1000
    return r


def _penalties(r: SamplingRows, vocab: int, rng: np.random.Generator) -> None:
    """Each row's entries as the engine sends them: the distinct tokens of its prompt and output
    (random ids) with their output counts; a bias on BIASED tokens."""
    n = len(r.temperature)
    ids, counts = [], []
    for _ in range(n):
        out = rng.integers(0, vocab, OUTPUT_TOKENS)
        u, c = np.unique(out, return_counts=True)
        only = np.setdiff1d(np.unique(rng.integers(0, vocab, PROMPT_TOKENS)), u, assume_unique=True)
        ids.append(np.concatenate([u, only]))
        counts.append(np.concatenate([c, np.zeros(len(only), np.int64)]))
    r.pen_lens = np.array([len(i) for i in ids])
    r.pen_ids, r.pen_counts = np.concatenate(ids), np.concatenate(counts)
    r.repetition, r.frequency, r.presence = np.full(n, 1.1), np.full(n, 0.5), np.full(n, 0.3)
    r.bias_lens = np.full(n, BIASED)
    r.bias_ids = np.concatenate([rng.choice(vocab, BIASED, replace=False) for _ in range(n)])
    r.bias_vals = np.full(n * BIASED, -5.0)


def naive_adjust(z: np.ndarray, r: SamplingRows) -> np.ndarray:
    """The adjustments a row at a time (what a per-request logits processor does)."""
    z = z.copy()
    b0 = p0 = 0
    for i in range(len(z)):
        nb, npn = int(r.bias_lens[i]), int(r.pen_lens[i])
        z[i, r.bias_ids[b0:b0 + nb]] += r.bias_vals[b0:b0 + nb]
        ids, c = r.pen_ids[p0:p0 + npn], r.pen_counts[p0:p0 + npn]
        v = z[i, ids]
        v = np.where(v > 0, v / r.repetition[i], v * r.repetition[i])
        z[i, ids] = v - r.frequency[i] * c - r.presence[i] * (c > 0)
        b0, p0 = b0 + nb, p0 + npn
    return z


def naive(z: np.ndarray, r: SamplingRows) -> np.ndarray:
    """The full-sort sampler: per row a stable float64 sort of the vocabulary."""
    vocab = z.shape[1]
    x = z.astype(np.float64) / r.temperature[:, None]
    order = np.argsort(-x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, axis=-1)
    k = np.where((r.top_k > 0) & (r.top_k < vocab), r.top_k, vocab)
    xs = np.where(np.arange(vocab)[None, :] < k[:, None], xs, -np.inf)
    p = np.exp(xs - xs[:, :1])
    p /= p.sum(axis=-1, keepdims=True)
    p = np.where(np.cumsum(p, axis=-1) - p < r.top_p[:, None], p, 0.0)
    cdf = np.cumsum(p, axis=-1)
    target = uniforms(r.seed, r.position)[:, None] * cdf[:, -1:]
    pick = np.minimum((cdf <= target).sum(axis=-1), k - 1)
    return np.take_along_axis(order, pick[:, None], axis=-1)[:, 0]


def torch_sampler() -> Callable[[np.ndarray, SamplingRows], Any] | None:
    """softmax + multinomial with sorted top-k / top-p, as a PyTorch user writes it; None
    without torch."""
    try:
        import torch
    except ImportError:
        return None

    def run(z: np.ndarray, r: SamplingRows) -> Any:
        x = torch.from_numpy(z) / torch.from_numpy(r.temperature.astype(np.float32))[:, None]
        k, p = int(r.top_k.max()), float(r.top_p.min())
        if k > 0:
            kth = torch.topk(x, k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if p < 1:
            xs, idx = torch.sort(x, descending=True, dim=-1)
            ps = torch.softmax(xs, dim=-1)
            drop = ps.cumsum(-1) - ps >= p
            x = x.scatter(-1, idx, xs.masked_fill(drop, float("-inf")))
        return torch.multinomial(torch.softmax(x, dim=-1), 1)

    return run


def nucleus_size(z: np.ndarray, top_p: float) -> float:
    """Mean tokens in the top-p nucleus of each row at temperature 1."""
    sizes = []
    for row in z.astype(np.float64):
        p = np.sort(np.exp(row - row.max()))[::-1]
        sizes.append(int(np.searchsorted(np.cumsum(p) / p.sum(), top_p)) + 1)
    return float(np.mean(sizes))


def measure(vocab: int, batches: list[int], repeat: int, naive_repeat: int) -> tuple[float, list[Row]]:
    rng = np.random.default_rng(0)
    gb_s = bandwidth_gb_s(repeat)
    th = torch_sampler()
    out = []
    for b in batches:
        z = {kind: logits(kind, b, vocab, rng) for kind in ("peaked", "flat")}
        greedy = best_ms(lambda: z["peaked"].argmax(axis=-1), repeat)
        limit = z["peaked"].nbytes / gb_s / 1e6
        for case, (kind, fields) in CASES.items():
            r, x = rows_for(b, fields, vocab, rng), z[kind]
            if "top_logprobs" in fields:
                ours = best_ms(lambda: (top_logprobs(x, r), sample(x, r)), repeat)
            else:
                ours = best_ms(lambda: sample(x, r), repeat)
            pen = "penalties" in fields
            if fields["temperature"] == 0:
                base = best_ms(lambda: naive_adjust(x, r).argmax(axis=-1), naive_repeat) if pen else greedy
                tt = None
            else:
                base = best_ms(lambda: naive(naive_adjust(x, r) if pen else x, r), naive_repeat, warm=False)
                tt = best_ms(lambda: th(adjust(x, r), r), repeat) if th else None
            nuc = nucleus_size(x, fields["top_p"]) if "top_p" in fields else None
            out.append(Row(b, case, ours, base, tt, limit, greedy, ours / greedy, base / greedy,
                           tt / greedy if tt is not None else None, nuc))
    return gb_s, out


@dataclass
class GuidedRow:
    batch: int
    case: str
    unmasked_ms: float
    masked_ms: float
    masked_vs_unmasked: float


def measure_guided(vocab: int, batches: list[int], repeat: int) -> list[GuidedRow]:
    """Every row guided vs none, same logits and parameters, side by side."""
    rng = np.random.default_rng(1)
    out = []
    for b in batches:
        x = logits("peaked", b, vocab, rng)
        keep = rng.random((b, mask_words(vocab) * 32)) < GUIDED_DENSITY
        words = np.packbits(keep, axis=-1, bitorder="little").view("<i4").astype(np.int32)
        for case in GUIDED_CASES:
            r = rows_for(b, CASES[case][1], vocab, rng)
            plain = best_ms(lambda: sample(x, r), repeat)
            r.allowed_rows, r.allowed = np.arange(b), words
            masked = best_ms(lambda: sample(x, r), repeat)
            out.append(GuidedRow(b, case, plain, masked, masked / plain))
    return out


def synthetic_vocabulary(vocab: int, seed: int = 0) -> dict[int, bytes]:
    """A byte-level vocabulary of `vocab` tokens: the 256 bytes, then distinct random pieces."""
    rng = np.random.default_rng(seed)
    pieces = {bytes([b]) for b in range(256)}
    alphabet = np.frombuffer(PIECE_ALPHABET, np.uint8)
    while len(pieces) < vocab:
        n = int(rng.integers(2, 9))
        pieces.add(rng.choice(alphabet, n).tobytes())
    return dict(enumerate(sorted(pieces)))


def measure_grammar(vocab: int) -> dict:
    """Seconds to compile the typical schema and JSON mode over a synthetic vocabulary (one
    run each: a compile is seconds, not noise), and microseconds per guided token for the
    engine's state update and mask write (a walk through allowed tokens)."""
    import time

    from outlines_core import Index

    eos = vocab - 1
    token_bytes = synthetic_vocabulary(vocab - 1)
    grammars = Grammars(Setup(pieces=[[t, b] for t, b in token_bytes.items()]), workers=1)  # a compile process
    schema = {"kind": "json_schema", "spec": json.dumps(SCHEMA)}
    out = {}
    try:
        grammars.compile({"kind": "regex", "spec": "x"}, eos).result()  # the vocabulary, built once, not timed
        for name, spec in (("json_schema", schema), ("json_object", {"kind": "json_object", "spec": ""})):
            t0 = time.perf_counter()
            grammars.compile(spec, eos).result()
            out[f"compile_{name}_s"] = time.perf_counter() - t0
        compiled = grammars.compile(schema, eos).result()
        data = compiled.index.__reduce__()[1][0]  # what a compile process sends (outlines-core's binary form)
        t0 = time.perf_counter()
        Index.from_binary(data)
        out["index_mib"] = len(data) / 2**20
        out["index_read_s"] = time.perf_counter() - t0  # the engine's side of shipping it, no pickle
        guide = GuideState(schema, grammars.compile(schema, eos), eos, vocab)
        guide.ready()
        rng = np.random.default_rng(2)
        steps, spent = 0, 0.0
        for _ in range(200):
            allowed = np.flatnonzero(np.unpackbits(guide.mask.view(np.uint8), bitorder="little")[:vocab])
            allowed = allowed[allowed != eos]
            if not len(allowed) or guide.problem:
                break
            token = int(rng.choice(allowed))
            t0 = time.perf_counter()
            guide.advance(token)  # the state, then the next mask
            spent += time.perf_counter() - t0
            steps += 1
        out["state_and_mask_us_per_token"] = spent / max(steps, 1) * 1e6
        out["walk_tokens"] = steps
    finally:
        grammars.close()
    return out


def print_table(vocab: int, gb_s: float, rows: list[Row]) -> None:
    print(f"vocab {vocab}, float32 logits; limit: one read at {gb_s:.1f} GB/s; x: over the greedy argmax "
          f"of the same batch; best of the repeats")

    def f(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else format("-", ">" + spec.lstrip(">").split(".")[0])

    print(f"{'batch':>5} {'case':<12} {'kvrt ms':>9} {'naive ms':>9} {'torch ms':>9} {'limit ms':>9} "
          f"{'kvrt x':>8} {'naive x':>8} {'torch x':>8} {'nucleus':>8}")
    for r in rows:
        print(f"{r.batch:>5} {r.case:<12} {r.kvrt_ms:>9.3f} {f(r.naive_ms, '>9.3f')} {f(r.torch_ms, '>9.3f')} "
              f"{r.limit_ms:>9.3f} {r.kvrt_vs_greedy:>8.1f} {f(r.naive_vs_greedy, '>8.1f')} "
              f"{f(r.torch_vs_greedy, '>8.1f')} {f(r.nucleus_tokens, '>8.0f')}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvrt bench sampler", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help='print {"vocab", "bandwidth_gb_s", "rows": [...]} '
                                                       'instead of a table')
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (default 151936)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per case, best kept (default 20)")
    p.add_argument("--naive-repeat", type=int, default=2, help="timed calls of the naive sampler (default 2)")
    p.add_argument("--no-guided", action="store_true", help="leave out guided decoding's masked steps and "
                                                            "grammar compile")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not batches or min(batches) < 1 or args.vocab < 1:
        p.error("--batches and --vocab must be positive")
    gb_s, rows = measure(args.vocab, batches, max(args.repeat, 1), max(args.naive_repeat, 1))
    guided = [] if args.no_guided else measure_guided(args.vocab, batches, max(args.repeat, 1))
    grammar = {} if args.no_guided else measure_grammar(args.vocab)
    if args.json:
        print(json.dumps({"vocab": args.vocab, "bandwidth_gb_s": gb_s, "rows": [asdict(r) for r in rows],
                          "guided": [asdict(g) for g in guided], "grammar": grammar}))
        return 0
    print_table(args.vocab, gb_s, rows)
    if guided:
        print(f"\nguided: every row masked ({GUIDED_DENSITY:.0%} of the vocabulary allowed) vs the same step unmasked")
        print(f"{'batch':>5} {'case':<8} {'unmasked ms':>12} {'masked ms':>10} {'masked x':>9}")
        for g in guided:
            print(f"{g.batch:>5} {g.case:<8} {g.unmasked_ms:>12.3f} {g.masked_ms:>10.3f} {g.masked_vs_unmasked:>9.2f}")
        print(f"grammar over a synthetic {args.vocab}-token byte-level vocabulary: compile "
              f"{grammar['compile_json_schema_s']:.2f} s (typical JSON schema), {grammar['compile_json_object_s']:.2f} s "
              f"(JSON mode); engine state + mask per guided token {grammar['state_and_mask_us_per_token']:.0f} us "
              f"({grammar['walk_tokens']} tokens); the schema's index {grammar['index_mib']:.2f} MiB, read back "
              f"in the engine in {grammar['index_read_s'] * 1e3:.1f} ms")
    return 0
