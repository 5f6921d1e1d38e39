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
- `sessions`: long sessions (a document or a long history under a root of its own, or one of a
  few shared system prompts) that come back at irregular, heavy-tailed intervals, between many
  one-off prompts; midway the shared prompts change version and sessions come back half as
  often. Its shape is that of a production trace's, in aggregate (`kvrt.bench.trace_shape`:
  about a fifth of block accesses are one-time, a block's first use comes back about half the
  time, reuse distances spread over a few cache sizes, a block's consecutive reuse gaps are
  only weakly correlated): the reuse `gaps` ranks by is there, but its last gap predicts the
  next one poorly; and sessions slow down as they age, so that their most used blocks are the
  least likely back soon: recency order beats reuse order from a few cache sizes on.
- `drifting`: `sessions` that keep their pace in the first half (reuse order pays) and slow
  down in the second (recency order pays).

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


def sessions(seed: int = 7, requests: int = 4000, shared: int = 40, one_shot: float = 0.4, turns: float = 8.0,
             gap: tuple[float, float] = (300.0, 600.0), slowdown: tuple[float, float] = (1.7, 1.7),
             spread: float = 1.35, noise: float = 1.15, own_root: float = 0.95) -> list[TraceRequest]:
    """`requests` requests over a clock of as many steps: sessions start at uniform times; a
    share `one_shot` of them is one prompt (1-10 blocks after its root), the others a context of
    5-47 blocks, then 1 + Geometric(1/`turns`) turns of 1-3 blocks each. A session's k-th turn
    comes back after a log-normal gap: a median of `gap` steps times `slowdown`**k (sessions
    that slow down: their oldest, most used blocks come back least soon), scaled by the
    session's own factor (log-normal, `spread`) and each gap's own (`noise`), so a block's
    consecutive gaps are only weakly correlated. A root is the session's own block (`own_root`
    of them) or one of `shared` system prompts of 2-8 blocks, Zipf-popular. `gap` and
    `slowdown` are (first half, second half) of the clock, by a session's start; from the middle
    on, sessions also start on a new version of every shared prompt."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    systems = [[ids.take(int(rng.integers(2, 9))) for _ in range(shared)] for _ in range(2)]
    popular = 1.0 / np.arange(1, shared + 1) ** 1.1
    popular /= popular.sum()
    horizon = float(requests)
    events: list[tuple[float, int, list[int]]] = []  # (time, order, hash ids)
    inside = 0
    while inside < requests:
        t = float(rng.uniform(0, horizon))
        late = int(t > horizon / 2)
        root = ids.take(1) if rng.random() < own_root else list(systems[late][int(rng.choice(shared, p=popular))])
        if rng.random() < one_shot:
            events.append((t, len(events), root + ids.take(int(rng.integers(1, 11)))))
            inside += t < horizon
            continue
        history = root + ids.take(int(rng.integers(5, 48)))
        scale = np.log(gap[late]) + spread * rng.standard_normal()
        for k in range(1 + int(rng.geometric(1.0 / turns))):
            history = history + ids.take(int(rng.integers(1, 4)))
            events.append((t, len(events), history))
            inside += t < horizon
            t += float(np.exp(scale + noise * rng.standard_normal())) * slowdown[late] ** k
    events.sort()
    return [_request(h, rng, i) for i, (_, _, h) in enumerate(e for e in events if e[0] < horizon)][:requests]


def drifting(seed: int = 8, requests: int = 6000) -> list[TraceRequest]:
    """`sessions` whose reuse changes midway: sessions that keep coming back at a steady pace
    (reuse order pays: a block used before is likely back), then sessions that slow down
    (recency order pays)."""
    return sessions(seed, requests, turns=9.3, gap=(850.0, 300.0), slowdown=(1.0, 1.7))


TRACES: dict[str, Callable[..., list[TraceRequest]]] = {"chats": chats, "docs": docs, "agents": agents,
                                                       "scans": scans, "qa": qa, "shifting": shifting,
                                                       "sessions": sessions, "drifting": drifting}


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
