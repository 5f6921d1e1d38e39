"""Replay requests against a live node and summarise what they cost.

The driver (`run`) keeps up to `concurrency` requests in flight on one Client and takes them from
a *source*: a trace replayed on its own clock (`TraceSource`, built with `trace_prompts`), or
anything that decides the next request from the answers of earlier ones (the demo's multi-turn
conversations, runtime/client/demo.py). `replay(client, specs, ...)` is the trace case in one call.

Trace scaling (`--tokens-per-id T`): a Mooncake trace id stands for 512 tokens. Replaying with T
tokens per id keeps the trace's sharing structure at T/512 of the cost: id h expands to the first
T tokens of its 512-token expansion (runtime/client/trace.py's formula), so equal ids give equal tokens,
and input_length scales by T/512 (rounded up, so a request keeps all its ids). Token words are
scrambled before they are brought into the model's vocabulary (`to_vocab`): a plain
`% vocab_size` of them makes unrelated ids share tokens.
runtime.client.trace.ideal_hit_tokens(requests, block_size, T) gives the ideal hit count of such a
scaled trace, at any block size (a block may end inside an id or span several).

`kvrt replay --port P [...]` is `main` below.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, TextIO

import numpy as np
from tqdm import tqdm

from kvrt.runtime.cache.metrics import TIERS, rate, token_rate_key
from kvrt.runtime.client.api import TokenEvent
from kvrt.runtime.client.client import CONNECT_TIMEOUT, DEFAULT_HOST, Client, ClientError, Result
from kvrt.runtime.client.trace import (TRACE_BLOCK, TraceError, TraceRequest, default_trace_path, expand_tokens, ideal_hit_tokens,
                           load_trace, to_vocab)

MAX_ERROR_MESSAGES = 5  # distinct error messages a run keeps to show


@dataclass
class PromptSpec:
    """One request to send. `arrival_s`: when it is due, in seconds from the start of the run at
    speed 1. `trace`: the (scaled) trace request it was made from, as sent."""

    prompt: np.ndarray
    max_new_tokens: int
    arrival_s: float = 0.0
    eos_token_id: int = -1
    tag: Any = None
    trace: TraceRequest | None = None


# ---- trace scaling ---------------------------------------------------------------------------

def scaled_length(input_length: int, tokens_per_id: int) -> int:
    """input_length * T / 512, rounded up: (n-1)*T < result <= n*T for a request of n ids."""
    return -(-input_length * tokens_per_id // TRACE_BLOCK)


def scaled_tokens(req: TraceRequest, tokens_per_id: int, vocab_size: int | None = None,
                  length: int | None = None) -> np.ndarray:
    """Prompt token ids of `req` (an unscaled trace request) with T tokens per id: the first T
    tokens of each id's 512-token expansion, cut to the scaled length (or `length`, shorter)."""
    _check_tpi(tokens_per_id)
    n = scaled_length(req.input_length, tokens_per_id) if length is None else length
    ids = req.hash_ids[:-(-n // tokens_per_id)]
    whole = TraceRequest(req.timestamp_ms, len(ids) * TRACE_BLOCK, 0, ids)
    tokens = expand_tokens(whole).reshape(len(ids), TRACE_BLOCK)[:, :tokens_per_id].ravel()[:n]
    if vocab_size is None:
        return np.ascontiguousarray(tokens)
    return to_vocab(tokens, vocab_size)


def _check_tpi(tokens_per_id: int) -> None:
    if not 1 <= tokens_per_id <= TRACE_BLOCK:
        raise ValueError(f"tokens per trace id must be 1..{TRACE_BLOCK}, got {tokens_per_id}")


def trace_prompts(requests: Sequence[TraceRequest], tokens_per_id: int = TRACE_BLOCK, *,
                  vocab_size: int | None = None, max_new_tokens_cap: int | None = None,
                  max_model_len: int | None = None) -> list[PromptSpec]:
    """PromptSpecs for trace requests: T tokens per id, output length from the trace (at least 1,
    at most the cap), arrival from the timestamp (relative to the first request). A prompt that
    would not fit `max_model_len` with its output is cut to fit (it keeps its shared prefix);
    `spec.trace` records the lengths actually sent."""
    if not requests:
        return []
    t0 = min(r.timestamp_ms for r in requests)
    out = []
    for i, req in enumerate(requests):
        new = max(1, req.output_length)
        if max_new_tokens_cap is not None:
            new = max(1, min(new, max_new_tokens_cap))
        n = scaled_length(req.input_length, tokens_per_id)
        if max_model_len is not None:
            if new >= max_model_len:
                new = max(1, max_model_len // 2)
            n = max(1, min(n, max_model_len - new))
        sent = TraceRequest(req.timestamp_ms, n, new, req.hash_ids)
        out.append(PromptSpec(scaled_tokens(req, tokens_per_id, vocab_size, n), new,
                              (req.timestamp_ms - t0) / 1000.0, tag=i, trace=sent))
    return out


def fit_requests(requests: Sequence[TraceRequest], tokens_per_id: int, max_model_len: int,
                 max_new_tokens_cap: int | None = None) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """(requests that fit, requests that do not): a request fits when its scaled prompt and its
    output (as trace_prompts sends them) stay within `max_model_len`. A replay skips, counts and
    reports the others rather than cutting their prompts, which would change the trace's sharing
    and its ideal hit rate without saying so."""
    fits, too_long = [], []
    for req in requests:
        new = max(1, req.output_length)
        if max_new_tokens_cap is not None:
            new = max(1, min(new, max_new_tokens_cap))
        (fits if scaled_length(req.input_length, tokens_per_id) + new <= max_model_len else too_long).append(req)
    return fits, too_long


SELECTIONS = ("first", "conversations")


def conversation_key(req: TraceRequest) -> tuple[int, ...]:
    """The requests of one conversation share their first two hash ids: every request of the
    bundled trace starts with the same id (a shared system prompt), and a conversation's later
    turns extend its first turn's prompt."""
    return req.hash_ids[:2]


def select_conversations(requests: Sequence[TraceRequest], n: int | None) -> tuple[list[TraceRequest], int]:
    """Whole conversations until `n` requests, in trace order, and how many conversations they
    come from: the multi-turn conversations first (in the order of their first turns), then
    one-turn ones while fewer than `n` (the last conversation taken may lose its last turns).
    The first `n` requests of a trace are mostly first turns whose later turns come much later,
    so they share little; whole conversations keep the reuse a prefix cache is for at any `n`."""
    groups: dict[tuple[int, ...], list[TraceRequest]] = {}
    for req in requests:
        groups.setdefault(conversation_key(req), []).append(req)
    ordered = sorted(groups.values(), key=lambda turns: len(turns) < 2)  # stable: first-turn order kept
    out: list[TraceRequest] = []
    conversations = 0
    for turns in ordered:
        if n is not None and len(out) >= n:
            break
        out += turns if n is None else turns[:n - len(out)]
        conversations += 1
    order = {id(r): i for i, r in enumerate(requests)}
    return sorted(out, key=lambda r: order[id(r)]), conversations


# ---- results ---------------------------------------------------------------------------------

def _pcts(values: list[float], which: Sequence[int]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in which}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in which}}


@dataclass
class ReplayResult:
    """What a run cost, summed over its finished requests (errors are counted apart)."""

    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_messages: list[str] = field(default_factory=list)  # the first distinct ones, "code: message"
    wall_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    output_tokens: int = 0
    preemptions: int = 0
    start_lag_s: list[float] = field(default_factory=list)  # submitted after due (concurrency bound)

    def add(self, r: Result) -> None:
        self.completed += 1
        self.cancelled += r.finish_reason == "cancelled"
        self.ttft_ms.append(r.ttft_ms)
        self.e2e_ms.append(r.e2e_ms)
        if r.tpot_ms is not None:
            self.tpot_ms.append(r.tpot_ms)
        self.prompt_tokens += r.prompt_tokens
        self.computed_prompt_tokens += r.computed_prompt_tokens
        for tier in TIERS:
            self.cached[tier] += getattr(r, f"cached_{tier}")
        self.output_tokens += r.num_output_tokens
        self.preemptions += r.preemptions

    def add_error(self, code: str, message: str = "") -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        line = f"{code}: {message}" if message else code
        if line not in self.error_messages and len(self.error_messages) < MAX_ERROR_MESSAGES:
            self.error_messages.append(line)

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def hit_rate(self, tier: str | None = None) -> float | None:
        """The token hit rate of one tier, or of all (runtime.cache.metrics.RATES), from what
        the answers reported: cached prompt tokens over prompt tokens."""
        counters = {"query_tokens": self.prompt_tokens, **{f"hit_tokens_{t}": n for t, n in self.cached.items()}}
        return rate(counters, token_rate_key(tier))

    def summary(self) -> dict:
        wall = self.wall_s or float("nan")
        return {
            "requests": self.submitted,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "errors": self.num_errors,
            "errors_by_code": dict(self.errors),
            "first_errors": list(self.error_messages),
            "wall_s": self.wall_s,
            "ttft_ms": _pcts(self.ttft_ms, (50, 90, 99)),
            "tpot_ms": _pcts(self.tpot_ms, (50, 99)),
            "e2e_ms": _pcts(self.e2e_ms, (50, 99)),
            "throughput": {"req_per_s": self.completed / wall, "output_tok_per_s": self.output_tokens / wall,
                           "prompt_tok_per_s": self.prompt_tokens / wall},
            "prompt_tokens": self.prompt_tokens,
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "cached_tokens": dict(self.cached),
            "hit_rate": {"total": self.hit_rate(), **{t: self.hit_rate(t) for t in TIERS}},
            "output_tokens": self.output_tokens,
            "preemptions": self.preemptions,
            "start_lag_s": _pcts(self.start_lag_s, (50, 99)),
        }


def fmt(v: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{suffix}"


def pct(v: float | None) -> str:
    return fmt(None if v is None else 100 * v, ".2f", "%")


def table(s: dict, title: str = "", extra: Sequence[tuple[str, str]] = ()) -> str:
    """The summary as a two-column table (`extra` rows appended)."""
    t, tp, th, hr = s["ttft_ms"], s["tpot_ms"], s["throughput"], s["hit_rate"]
    errs = str(s["errors"]) + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_code"].items())) + ")"
                               if s["errors"] else "")
    rows = [
        ("requests", f"{s['completed']} done of {s['requests']} in {s['wall_s']:.1f} s"
                     + (f" ({s['cancelled']} cancelled)" if s["cancelled"] else "")),
        ("errors", errs),
        ("TTFT p50 / p90 / p99", f"{fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} ms"),
        ("TTFT mean", f"{fmt(t['mean'])} ms"),
        ("TPOT p50 / p99", f"{fmt(tp['p50'], '.2f')} / {fmt(tp['p99'], '.2f')} ms"),
        ("throughput", f"{fmt(th['req_per_s'], '.2f')} req/s, {fmt(th['output_tok_per_s'], '.1f')} output tok/s, "
                       f"{fmt(th['prompt_tok_per_s'], '.0f')} prompt tok/s"),
        ("prompt tokens computed", f"{s['computed_prompt_tokens']:,} of {s['prompt_tokens']:,}"),
        ("hit rate", f"{pct(hr['total'])} (device {pct(hr['device'])}, host {pct(hr['host'])}, "
                     f"storage {pct(hr['storage'])})"),
    ]
    if s["preemptions"]:
        rows.append(("preemptions", str(s["preemptions"])))
    rows += list(extra)
    width = max(len(k) for k, _ in rows)
    lines = [title] if title else []
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


# ---- progress --------------------------------------------------------------------------------

@dataclass
class Progress:
    done: int        # finished or failed
    total: int
    errors: int
    in_flight: int
    elapsed_s: float

    @property
    def rate(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        return (self.total - self.done) / self.rate if self.rate > 0 else None

    def line(self, label: str = "") -> str:
        eta = fmt(self.eta_s, ".0f", " s")
        head = f"{label}: " if label else ""
        return (f"{head}{self.done}/{self.total} done, {self.in_flight} in flight, {self.rate:.1f} req/s, "
                f"ETA {eta}, {self.errors} errors")


class ProgressBar:
    """Progress on a stream: a tqdm bar redrawn in place on a terminal (rate, ETA, requests in
    flight, errors), a plain line every few seconds otherwise (logs stay readable: no carriage
    returns or escape codes in them)."""

    def __init__(self, label: str = "replay", stream: TextIO | None = None, every_s: float | None = None):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s if every_s is not None else (0.2 if self.tty else 5.0)
        self._last = -math.inf
        self._bar: tqdm | None = None
        self._closed = False

    def __call__(self, p: Progress) -> None:
        final = p.done >= p.total and p.in_flight == 0
        if self.tty:
            self._draw(p, final)
            return
        now = time.monotonic()
        if not final and now - self._last < self.every_s:
            return
        self._last = now
        self.stream.write(p.line(self.label) + "\n")
        self.stream.flush()

    def _draw(self, p: Progress, final: bool) -> None:
        if self._closed:
            return
        if self._bar is None:
            # tqdm draws nothing on a terminal that reports a size of 0 x 0; shutil falls back to 80 x 24
            size = shutil.get_terminal_size()
            self._bar = tqdm(total=p.total, desc=self.label, unit="req", file=self.stream, mininterval=self.every_s,
                             ncols=size.columns, nrows=size.lines, leave=True)
        self._bar.total = p.total  # a source may issue fewer requests than it first said
        self._bar.set_postfix(in_flight=p.in_flight, errors=p.errors, refresh=False)
        self._bar.update(p.done - self._bar.n)
        if final:
            self._bar.close()
            self._closed = True


def progress_lines(emit: Callable[[str], None], label: str = "", every_s: float = 2.0) -> Callable[[Progress], None]:
    """A progress callback that passes a line to `emit` every `every_s` seconds and at the end."""
    last = [-math.inf]

    def cb(p: Progress) -> None:
        now = time.monotonic()
        if (p.done >= p.total and p.in_flight == 0) or now - last[0] >= every_s:
            last[0] = now
            emit(p.line(label))

    return cb


# ---- the driver ------------------------------------------------------------------------------

class Source(Protocol):
    """Where the driver takes requests from."""

    total: int  # requests it will issue in all (may shrink when a dependency fails)

    def next_ready(self, now_s: float) -> PromptSpec | None:
        """A request that is due at `now_s` (seconds since the run started), or None."""

    def next_due(self) -> float | None:
        """When the next request not yet due becomes due; None if none is waiting on the clock."""

    def completed(self, spec: PromptSpec, result: Result | None) -> None:
        """A request ended: its Result, or None if it failed."""

    def exhausted(self) -> bool:
        """True once every request has been handed out (nothing more will come)."""


class TraceSource:
    """Requests due at arrival_s / speed; speed 0 or inf: all due at once."""

    def __init__(self, specs: Sequence[PromptSpec], speed: float = 1.0):
        if speed < 0 or math.isnan(speed):
            raise ValueError(f"speed must be >= 0 (0 or inf: as fast as possible), got {speed}")
        self.specs = sorted(specs, key=lambda s: s.arrival_s)
        self.fast = speed == 0 or math.isinf(speed)
        self.speed = speed
        self.total = len(self.specs)
        self._next = 0

    def due(self, spec: PromptSpec) -> float:
        return 0.0 if self.fast else spec.arrival_s / self.speed

    def next_ready(self, now_s: float) -> PromptSpec | None:
        if self._next < len(self.specs) and self.due(self.specs[self._next]) <= now_s:
            self._next += 1
            return self.specs[self._next - 1]
        return None

    def next_due(self) -> float | None:
        return self.due(self.specs[self._next]) if self._next < len(self.specs) else None

    def completed(self, spec: PromptSpec, result: Result | None) -> None:
        pass

    def exhausted(self) -> bool:
        return self._next >= len(self.specs)


TICK_S = 0.1


def run(client: Client, source: Source, *, concurrency: int = 16, use_cache: bool = True,
        progress: Callable[[Progress], None] | None = None, timeout: float | None = None,
        due_of: Callable[[PromptSpec], float] | None = None) -> ReplayResult:
    """Drive `source` against the node: up to `concurrency` requests in flight, each submitted
    once due. ClientError if the node sends nothing for `timeout` s (the client's timeout by
    default) while requests are in flight; those are cancelled first. Ctrl-C cancels the
    requests in flight and re-raises."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    timeout = client.timeout if timeout is None else timeout
    res = ReplayResult()
    inflight: dict[str, PromptSpec] = {}
    done = 0
    t0 = time.perf_counter()
    last_heard = t0
    try:
        while True:
            now = time.perf_counter()
            while len(inflight) < concurrency:
                spec = source.next_ready(now - t0)
                if spec is None:
                    break
                rid = client.submit(spec.prompt, spec.max_new_tokens, eos_token_id=spec.eos_token_id,
                                    use_cache=use_cache)
                if due_of is not None:
                    res.start_lag_s.append(max(0.0, now - t0 - due_of(spec)))
                inflight[rid] = spec
                res.submitted += 1
                if len(inflight) == 1:
                    last_heard = now
            if not inflight and source.exhausted():
                break
            due = source.next_due() if len(inflight) < concurrency else None
            wait = TICK_S if due is None else min(TICK_S, max(0.0, due - (now - t0)))
            if not inflight and due is None:
                raise RuntimeError("replay source has requests left but none in flight and none due")
            events = client.poll(wait)
            now = time.perf_counter()
            for ev in events:
                if isinstance(ev, TokenEvent):
                    continue  # the client times the first token; Result has the whole answer
                spec = inflight.pop(ev.request_id, None)
                if spec is None:
                    continue  # not one of ours (e.g. the answer to a stray cancel)
                done += 1
                if isinstance(ev, Result):
                    res.add(ev)
                    source.completed(spec, ev)
                else:
                    res.add_error(ev.code, ev.message)
                    source.completed(spec, None)
            if events:
                last_heard = now
            elif inflight and now - last_heard > timeout:
                raise ClientError(f"no answer from {client.address} for {timeout:g} s with {len(inflight)} "
                                  f"requests in flight ({done} of {source.total} done)")
            if progress is not None:
                progress(Progress(done, source.total, res.num_errors, len(inflight), now - t0))
    except BaseException:
        for rid in inflight:
            try:
                client.cancel(rid)
            except ClientError:
                break
        raise
    finally:
        res.wall_s = time.perf_counter() - t0
    return res


def replay(client: Client, specs: Sequence[PromptSpec], *, speed: float = 0.0, concurrency: int = 16,
           use_cache: bool = True, progress: Callable[[Progress], None] | None = None,
           timeout: float | None = None) -> ReplayResult:
    """Replay independent requests on the trace's clock (divided by `speed`; 0 or inf = as fast as
    `concurrency` allows) and summarise them."""
    src = TraceSource(specs, speed)
    return run(client, src, concurrency=concurrency, use_cache=use_cache, progress=progress, timeout=timeout,
               due_of=src.due)


# ---- kvrt replay -----------------------------------------------------------------------------

def add_trace_args(p: argparse.ArgumentParser, *, limit: int | None, tokens_per_id: int, concurrency: int,
                   cap: int | None, speed: float, select: str = "first") -> None:
    """Options shared by `kvrt replay` and `kvrt bench replay`."""
    p.add_argument("--trace", type=Path, default=None,
                   help=f"Mooncake-format trace (JSON lines with hash_ids); default: {default_trace_path()}")
    p.add_argument("--limit", type=int, default=limit, metavar="N",
                   help="replay only N requests (see --select)" + (f" (default {limit})" if limit else " (default: all)"))
    p.add_argument("--select", choices=SELECTIONS, default=select,
                   help="which requests: first = the trace's first N in order; conversations = whole conversations "
                        "(requests sharing their first two hash ids), multi-turn ones first, until N requests: "
                        f"prefix reuse even at a small N (default {select})")
    p.add_argument("--speed", type=float, default=speed, metavar="X",
                   help=f"divide the trace's arrival times by X; 0 or inf: as fast as --concurrency allows "
                        f"(default {speed:g})")
    p.add_argument("--tokens-per-id", type=int, default=tokens_per_id, metavar="T",
                   help=f"tokens per trace hash id, 1..512 (the trace's 512 scaled by T/512; "
                        f"default {tokens_per_id})")
    p.add_argument("--concurrency", type=int, default=concurrency, metavar="C",
                   help=f"most requests in flight (default {concurrency})")
    p.add_argument("--max-new-tokens-cap", type=int, default=cap, metavar="M",
                   help="cap the trace's output lengths at M tokens" + (f" (default {cap})" if cap else ""))
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="give up when the node sends nothing for S seconds (default 60)")


def check_trace_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if not 1 <= args.tokens_per_id <= TRACE_BLOCK:
        p.error(f"--tokens-per-id must be 1..{TRACE_BLOCK}, got {args.tokens_per_id}")
    if args.concurrency < 1:
        p.error(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.speed < 0 or math.isnan(args.speed):
        p.error(f"--speed must be >= 0 (0 or inf: as fast as possible), got {args.speed}")
    if args.max_new_tokens_cap is not None and args.max_new_tokens_cap < 1:
        p.error(f"--max-new-tokens-cap must be >= 1, got {args.max_new_tokens_cap}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    if args.trace is None:
        args.trace = default_trace_path()
        if not args.trace.exists():
            p.error(f"no trace at the default path {args.trace}: pass --trace FILE (a Mooncake-format trace)")
    elif not args.trace.exists():
        p.error(f"--trace {args.trace}: no such file")


def select_requests(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    """The requests --select and --limit take from the trace, and what they are, in words."""
    select = getattr(args, "select", "first")
    try:
        requests = load_trace(args.trace, args.limit if select == "first" else None)
    except (OSError, TraceError) as e:
        p.error(str(e))
    if not requests:
        p.error(f"{args.trace} has no requests")
    if select == "first":
        return requests, f"the first {len(requests)} requests"
    chosen, conversations = select_conversations(requests, args.limit)
    return chosen, f"{len(chosen)} requests of {conversations} whole conversations"


def load_requests(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[TraceRequest]:
    """select_requests without the words, for commands that do not say what they took."""
    return select_requests(p, args)[0]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrt replay",
        description="Replay a Mooncake-format request trace against a running node (kvrt launch --port P) and "
                    "report TTFT, TPOT, throughput and prefix-cache hit rates per tier.")
    p.add_argument("--port", type=int, required=True, help="the node's client API port")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"the node's host (default {DEFAULT_HOST})")
    add_trace_args(p, limit=None, tokens_per_id=8, concurrency=16, cap=32, speed=1.0)
    p.add_argument("--no-cache", action="store_true", help="neither use nor fill the prefix cache")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def main(argv: list[str]) -> int:
    """`kvrt replay`: exit 0 every request done, 1 any request failed (how many and the first
    distinct errors go to stderr) or the node unreachable or silent, 2 bad arguments, 130
    interrupted."""
    p = parser()
    args = p.parse_args(argv)
    check_trace_args(p, args)
    if not 0 < args.port <= 65535:
        p.error(f"--port must be 1..65535, got {args.port}")
    requests, taken = select_requests(p, args)
    try:
        with Client(args.port, args.timeout, host=args.host,
                    connect_timeout=min(args.timeout, CONNECT_TIMEOUT)) as c:
            info = c.info()
            fits, too_long = fit_requests(requests, args.tokens_per_id, info.max_model_len, args.max_new_tokens_cap)
            if too_long:
                print(f"kvrt replay: skipping {len(too_long)} of {len(requests)} requests longer than the node's "
                      f"max_model_len {info.max_model_len} at {args.tokens_per_id} tokens per id (a smaller "
                      f"--tokens-per-id keeps them)", file=sys.stderr)
            if not fits:
                print("kvrt replay: error: no request fits the node's max_model_len", file=sys.stderr)
                return 1
            specs = trace_prompts(fits, args.tokens_per_id, vocab_size=info.vocab_size,
                                  max_new_tokens_cap=args.max_new_tokens_cap)
            res = replay(c, specs, speed=args.speed, concurrency=args.concurrency, use_cache=not args.no_cache,
                         progress=ProgressBar("replay"))
    except KeyboardInterrupt:
        print("\nkvrt replay: interrupted (requests in flight cancelled)", file=sys.stderr)
        return 130
    except ClientError as e:
        print(f"kvrt replay: error: {e}", file=sys.stderr)
        return 1
    scaled = [s.trace for s in specs]
    ideal = ideal_hit_tokens(scaled, info.block_size, args.tokens_per_id)
    total = sum(t.input_length for t in scaled)
    out = res.summary()
    out["ideal_hit_rate"] = ideal / total if total else None
    out["config"] = {"trace": str(args.trace), "requests": len(specs), "tokens_per_id": args.tokens_per_id,
                     "speed": args.speed, "concurrency": args.concurrency,
                     "max_new_tokens_cap": args.max_new_tokens_cap, "use_cache": not args.no_cache,
                     "block_size": info.block_size, "node": info.node, "select": args.select, "taken": taken,
                     "skipped_too_long": len(too_long)}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        title = (f"replay of {taken} of {args.trace.name} on node {info.node} ({args.tokens_per_id} "
                 f"tokens per id, speed {args.speed:g}, concurrency {args.concurrency}, cache "
                 f"{'off' if args.no_cache else 'on'})")
        extra = [("ideal hit rate", f"{pct(out['ideal_hit_rate'])} (unlimited cache, one request at a time, "
                                    f"block {info.block_size})")]
        if too_long:
            extra.append(("skipped", f"{len(too_long)} requests longer than max_model_len {info.max_model_len}"))
        print(table(out, title, extra))
    if res.num_errors:
        print(f"kvrt replay: {res.num_errors} of {res.submitted} requests failed; first errors:", file=sys.stderr)
        for line in res.error_messages:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0
