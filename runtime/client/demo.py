"""The built-in demo workload (`kvrt launch --demo`): multi-turn chats over shared system prompts.

Everything is generated here from a seed, so the demo needs no data files. A few system prompts are
shared by many conversations; each conversation's next turn sends the previous prompt, the
engine's actual answer to it and a new user message. Both kinds of reuse are what a prefix cache
is for: the system prompt across conversations, the whole history within one.

Turns of one conversation run in order (a turn's prompt depends on the previous answer);
conversations run concurrently, at most `concurrency` requests in flight. Sizes are parameters
of `build_workload`; the defaults (24 conversations of 3-4 turns, prompts of ~100-600 tokens,
16-32 new tokens) keep the demo well under a minute on a 2-core CPU with the default model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvrt.runtime.client.client import DEFAULT_HOST, Client, Result
from kvrt.runtime.client.replay import TIERS, Progress, ProgressBar, PromptSpec, ReplayResult, fmt, pct, progress_lines, run


@dataclass
class Conversation:
    index: int
    system: int                       # which shared system prompt it starts with
    user: list[np.ndarray]            # one user message per turn
    max_new_tokens: list[int]         # per turn

    @property
    def turns(self) -> int:
        return len(self.user)


@dataclass
class Workload:
    seed: int
    vocab_size: int
    system_prompts: list[np.ndarray]
    conversations: list[Conversation]

    @property
    def total_requests(self) -> int:
        return sum(c.turns for c in self.conversations)

    def first_prompt(self, conv: Conversation) -> np.ndarray:
        return np.concatenate([self.system_prompts[conv.system], conv.user[0]]).astype(np.int32)

    @staticmethod
    def next_prompt(prompt: np.ndarray, answer: np.ndarray, user: np.ndarray) -> np.ndarray:
        """Turn k+1: the prompt of turn k, the answer it got, then the new user message."""
        return np.concatenate([prompt, np.asarray(answer, dtype=np.int32), user]).astype(np.int32)


def build_workload(seed: int = 0, vocab_size: int = 256, *, conversations: int = 24, turns: tuple[int, int] = (3, 4),
                   system_prompts: int = 3, system_tokens: tuple[int, int] = (96, 192),
                   user_tokens: tuple[int, int] = (24, 64), new_tokens: tuple[int, int] = (16, 32)) -> Workload:
    """A deterministic workload: the same seed and sizes give the same token ids. Ranges are
    inclusive (lo, hi); token ids are drawn uniformly from 0..vocab_size-1."""
    for name, (lo, hi) in (("turns", turns), ("system_tokens", system_tokens), ("user_tokens", user_tokens),
                           ("new_tokens", new_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    if conversations < 1 or system_prompts < 1 or vocab_size < 2:
        raise ValueError("need at least one conversation, one system prompt and a vocabulary of 2 ids")
    rng = np.random.default_rng(seed)

    def draw(lo_hi: tuple[int, int]) -> int:
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, vocab_size, size=n, dtype=np.int64).astype(np.int32)

    systems = [tokens(draw(system_tokens)) for _ in range(system_prompts)]
    convs = []
    for i in range(conversations):
        n = draw(turns)
        convs.append(Conversation(index=i, system=i % system_prompts,
                                  user=[tokens(draw(user_tokens)) for _ in range(n)],
                                  max_new_tokens=[draw(new_tokens) for _ in range(n)]))
    return Workload(seed, vocab_size, systems, convs)


class ConversationSource:
    """A replay source: turn 0 of every conversation is due at once; turn k+1 becomes due when
    turn k finished (built from its actual answer). A failed turn ends its conversation."""

    def __init__(self, workload: Workload, eos_token_id: int = -1):
        self.w = workload
        self.eos = eos_token_id
        self.total = workload.total_requests
        self.abandoned = 0
        self._ready: deque[PromptSpec] = deque(
            PromptSpec(workload.first_prompt(c), c.max_new_tokens[0], eos_token_id=eos_token_id, tag=(c.index, 0))
            for c in workload.conversations)
        self._waiting = len(self._ready)   # conversations with a turn ready or in flight

    def next_ready(self, now_s: float) -> PromptSpec | None:
        return self._ready.popleft() if self._ready else None

    def next_due(self) -> float | None:
        return None  # nothing waits on the clock: turns wait on answers

    def completed(self, spec: PromptSpec, result: Result | None) -> None:
        ci, turn = spec.tag
        conv = self.w.conversations[ci]
        if result is None:
            left = conv.turns - turn - 1
            self.total -= left
            self.abandoned += left
            self._waiting -= 1
        elif turn + 1 < conv.turns:
            prompt = Workload.next_prompt(spec.prompt, result.output_token_ids, conv.user[turn + 1])
            self._ready.append(PromptSpec(prompt, conv.max_new_tokens[turn + 1], eos_token_id=self.eos,
                                          tag=(ci, turn + 1)))
        else:
            self._waiting -= 1

    def exhausted(self) -> bool:
        return not self._ready and self._waiting == 0


@dataclass
class DemoResult:
    workload: Workload
    replay: ReplayResult
    node: str = ""
    block_size: int = 0
    concurrency: int = 0
    abandoned_turns: int = 0
    summary: dict = field(default_factory=dict)


def run_demo(port: int | str, progress: Callable[[str], None] | None = None, *, host: str = DEFAULT_HOST,
             seed: int = 0, concurrency: int = 8, timeout: float = 60.0, use_cache: bool = True,
             bar: Callable[[Progress], None] | None = None, **sizes) -> DemoResult:
    """Run the demo workload against the node serving `port` (sizes: see build_workload);
    `progress` gets a status line now and then, or `bar` (e.g. a runtime.client.replay.ProgressBar)
    every Progress instead."""
    with Client(port, timeout, host=host) as c:
        info = c.info()
        w = build_workload(seed, info.vocab_size, **sizes)
        src = ConversationSource(w)
        cb = bar if bar is not None else progress_lines(progress, "demo") if progress is not None else None
        res = run(c, src, concurrency=concurrency, use_cache=use_cache, progress=cb)
    return DemoResult(w, res, info.node, info.block_size, concurrency, src.abandoned, res.summary())


def render(result: DemoResult) -> str:
    """The results table."""
    s, w = result.summary, result.workload
    t, hr, th = s["ttft_ms"], s["hit_rate"], s["throughput"]
    computed, total = s["computed_prompt_tokens"], s["prompt_tokens"]
    rows = [
        ("workload", f"{len(w.conversations)} conversations, {len(w.system_prompts)} shared system prompts, "
                     f"{w.total_requests} turns (seed {w.seed})"),
        ("requests", f"{s['completed']} done, {s['errors']} errors in {s['wall_s']:.1f} s "
                     f"(concurrency {result.concurrency})"),
        ("TTFT mean / p50 / p99", f"{fmt(t['mean'])} / {fmt(t['p50'])} / {fmt(t['p99'])} ms"),
        ("hit rate", f"{pct(hr['total'])}: " + ", ".join(f"{tier} {pct(hr[tier])}" for tier in TIERS)),
        ("prompt tokens computed", f"{computed:,} of {total:,}"
                                   + (f" ({pct(computed / total)})" if total else "")),
        ("tokens/s", f"{fmt(th['output_tok_per_s'])} output, {fmt(th['prompt_tok_per_s'], '.0f')} prompt"),
    ]
    if s["errors"]:
        rows.append(("errors by code", ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_code"].items()))))
    if result.abandoned_turns:
        rows.append(("turns skipped", f"{result.abandoned_turns} (their conversation's earlier turn failed)"))
    width = max(len(k) for k, _ in rows)
    head = f"kvrt demo on node {result.node}" + (f" (block size {result.block_size})" if result.block_size else "")
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


def demo_job(cfg) -> Callable[[], int]:
    """The node's job for `kvrt launch --demo`: run the demo against the node's own client API
    once it is ready, print the results table on stdout; exit code 0, or 1 if a request failed
    or the node did not answer."""
    import sys

    from kvrt.runtime.client.client import ClientError

    host = DEFAULT_HOST if cfg.host in ("", "0.0.0.0", "::", "*") else cfg.host

    def job() -> int:
        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        try:
            result = run_demo(cfg.port, say, host=host, bar=ProgressBar("demo"))
        except ClientError as e:
            say(f"kvrt demo: error: {e}")
            return 1
        print(render(result), flush=True)
        from kvrt.runtime.node.status import render as render_status, snapshot

        print("\nkvrt status --node " + cfg.node + "\n" + render_status(snapshot(cfg.node)), flush=True)
        return 1 if result.summary["errors"] else 0

    return job
