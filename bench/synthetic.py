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
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from kvrt.runtime.client.trace import TRACE_BLOCK, TraceRequest

PREFIX = "synthetic:"


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


TRACES: dict[str, Callable[[], list[TraceRequest]]] = {"chats": chats, "docs": docs, "agents": agents}


def synthetic(name: str) -> list[TraceRequest]:
    """The synthetic trace `name` (one of TRACES)."""
    try:
        return TRACES[name]()
    except KeyError:
        raise ValueError(f"unknown synthetic trace {name!r} (known: {', '.join(TRACES)})") from None
