"""Synthetic request traces for `kvrt bench cache --trace synthetic:NAME`: shapes of reuse the
bundled conversation trace does not have, so that an eviction policy is judged on more than one
workload. Each is generated in code from a fixed seed (the same requests every run), in the
Mooncake format of runtime/client/trace.py (one hash id per 512-token block).

- `chats`: many short multi-turn chats under a few shared system prompts, interleaved; each turn
  repeats the conversation so far and adds a user message and an answer.
- `docs`: a few long documents, each asked many questions (a popular document far more often:
  Zipf), every question unique.
- `agents`: agent loops over one long shared tool prompt, each step repeating the agent's whole
  history and adding a tool result, interleaved.
- `scans`: interleaved chats, as `chats`, hit by bursts of long one-off prompts (batch jobs)
  that a recency order lets flush the chats.
- `qa`: long documents that arrive over time, each asked many questions while it is current
  (popularity shifts: yesterday's document is not asked about again).
- `shifting`: agent loops whose shared prefix grows and changes version over time (a tool list
  that gains a tool, then a new system prompt), each loop on the version current at its start.

Seeds: `synthetic:NAME` is the reported trace (a fixed seed per family); `synthetic:NAME:SEED`
generates the same family from another seed. Eviction policies are tuned on seeds
DEV_SEEDS only, and reported on the default ones, which they were never tuned on.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from kvrt.runtime.client.trace import TRACE_BLOCK, TraceRequest

PREFIX = "synthetic:"
DEV_SEEDS = range(100, 104)  # the seeds policies may be tuned on (never the reported ones)


class _Ids:
    """Fresh trace ids (a counter: equal ids mean equal content)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(hash_ids: list[int], rng: np.random.Generator, t: int) -> TraceRequest:
    """A request over `hash_ids` whose last block is partly filled."""
    length = (len(hash_ids) - 1) * TRACE_BLOCK + int(rng.integers(1, TRACE_BLOCK + 1))
    return TraceRequest(t, length, int(rng.integers(16, 512)), tuple(hash_ids))


def _interleaved(rng: np.random.Generator, ids: _Ids, total: int, active: int,
                 start: Callable[[], tuple[list[int], int]], turn: Callable[[], int]) -> list[TraceRequest]:
    """`total` conversations, `active` at a time, one request per turn of a conversation picked at
    random: `start()` gives a new one's history and turns, `turn()` the blocks a turn adds."""
    live: list[tuple[list[int], int]] = []  # (history, turns left)
    started = 0
    out: list[TraceRequest] = []
    while started < total or live:
        while len(live) < active and started < total:
            live.append(start())
            started += 1
        k = int(rng.integers(len(live)))
        history, left = live[k]
        history = history + ids.take(turn())
        out.append(_request(history, rng, len(out)))
        if left > 1:
            live[k] = (history, left - 1)
        else:
            live.pop(k)
    return out


def chats(seed: int = 1, conversations: int = 1500, active: int = 48) -> list[TraceRequest]:
    """Short chats (2-8 turns, 1-3 blocks per turn) under 4 system prompts of 2 blocks each."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    systems = [ids.take(2) for _ in range(4)]
    return _interleaved(rng, ids, conversations, active,
                        lambda: (list(systems[int(rng.integers(len(systems)))]), int(rng.integers(2, 9))),
                        lambda: int(rng.integers(1, 4)))


def docs(seed: int = 2, documents: int = 24, questions: int = 2000) -> list[TraceRequest]:
    """Long documents (40-160 blocks) asked unique one-block questions, Zipf over documents."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    texts = [ids.take(int(rng.integers(40, 161))) for _ in range(documents)]
    weights = 1.0 / np.arange(1, documents + 1)
    picks = rng.choice(documents, size=questions, p=weights / weights.sum())
    return [_request(texts[int(d)] + ids.take(1), rng, t) for t, d in enumerate(picks)]


def agents(seed: int = 3, loops: int = 96, steps: int = 40, active: int = 16) -> list[TraceRequest]:
    """Agent loops over a shared 24-block tool prompt, each step adding 1-2 blocks of tool output;
    `active` loops at a time, interleaved."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    tools = ids.take(24)
    return _interleaved(rng, ids, loops, active, lambda: (tools + ids.take(2), steps),
                        lambda: int(rng.integers(1, 3)))


def scans(seed: int = 4, conversations: int = 1200, active: int = 48, burst_every: int = 300,
          burst: int = 12) -> list[TraceRequest]:
    """`chats` with a burst of `burst` one-off prompts (20-80 blocks each) every ~`burst_every`
    requests."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    systems = [ids.take(2) for _ in range(4)]
    chat = _interleaved(rng, ids, conversations, active,
                        lambda: (list(systems[int(rng.integers(len(systems)))]), int(rng.integers(2, 9))),
                        lambda: int(rng.integers(1, 4)))
    out: list[TraceRequest] = []
    for i, r in enumerate(chat):
        if i and rng.random() < 1 / burst_every:
            out += [_request(ids.take(int(rng.integers(20, 81))), rng, 0) for _ in range(burst)]
        out.append(r)
    return [TraceRequest(t, r.input_length, r.output_length, r.hash_ids) for t, r in enumerate(out)]


def qa(seed: int = 5, documents: int = 60, questions: int = 2400, live: int = 4) -> list[TraceRequest]:
    """Documents of 20-100 blocks arriving one after another; each question picks one of the
    `live` newest (the newest most often) and adds a unique 1-2 block question."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    texts = [ids.take(int(rng.integers(20, 101))) for _ in range(documents)]
    out = []
    for t in range(questions):
        newest = min(documents - 1, t * documents // questions)
        back = min(newest, int(rng.geometric(0.5)) - 1, live - 1)
        out.append(_request(texts[newest - back] + ids.take(int(rng.integers(1, 3))), rng, t))
    return out


def shifting(seed: int = 6, loops: int = 160, steps: int = 25, active: int = 12,
             versions: int = 8) -> list[TraceRequest]:
    """Agent loops whose shared prefix changes as loops start: versions of a tool prompt, each
    the previous one plus a tool (2-6 blocks), a new system prompt (8-16 blocks) every third
    version; each step adds 1-3 blocks."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    prompt = ids.take(12)
    prefixes = []
    for v in range(versions):
        prompt = (ids.take(int(rng.integers(8, 17))) + prompt[-8:] if v and v % 3 == 0
                  else prompt + ids.take(int(rng.integers(2, 7))))
        prefixes.append(prompt)
    started = [0]

    def start() -> tuple[list[int], int]:
        v = min(versions - 1, started[0] * versions // loops)
        started[0] += 1
        return prefixes[v] + ids.take(2), int(rng.integers(steps // 2, steps + 1))

    return _interleaved(rng, ids, loops, active, start, lambda: int(rng.integers(1, 4)))


TRACES: dict[str, Callable[..., list[TraceRequest]]] = {"chats": chats, "docs": docs, "agents": agents,
                                                       "scans": scans, "qa": qa, "shifting": shifting}


def synthetic(name: str) -> list[TraceRequest]:
    """The synthetic trace `name`: a family of TRACES, with `:SEED` for another seed than the
    reported one."""
    family, _, seed = name.partition(":")
    try:
        make = TRACES[family]
    except KeyError:
        raise ValueError(f"unknown synthetic trace {family!r} (known: {', '.join(TRACES)})") from None
    if not seed:
        return make()
    if not seed.isdigit():
        raise ValueError(f"synthetic trace {name!r}: the seed after ':' must be a number")
    return make(seed=int(seed))
