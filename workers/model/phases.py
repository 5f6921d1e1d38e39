"""Where a step's time goes: seconds per named phase (projections, attention, the LM head,
host<->device copies, sampling), summed until read.

Why a recorder the model holds rather than a profiler: a profiler's overhead lands on the
small operations of a decode step unevenly and its names are numpy's, not the model's; this one
reads one clock around each phase, and only when a benchmark attached it (the model's `phases`
is None while serving, so the serving path pays one attribute check per phase). On a GPU a
phase's kernels run asynchronously, so each span synchronises the device before it reads the
clock, at both ends: the figures are the phases' own, at the price of the overlap a serving
step would have had.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

PROJECTIONS = "projections"  # q/k/v/o and MLP matmuls
ATTENTION = "attention"      # K/V written to the pool, then attention over it
LM_HEAD = "lm_head"          # the last positions' logits
COPIES = "copies"            # host<->device: a step's inputs up, its logits down
SAMPLING = "sampling"        # choosing the tokens (timed by the caller: the model returns logits)
OTHER = "other"              # the rest of a step (norms, RoPE, residual adds, validation)


class PhaseClock:
    """Seconds spent in each named phase, summed over spans since the last `take`."""

    def __init__(self, xp: Any = np) -> None:
        self.xp = xp
        self.seconds: dict[str, float] = {}

    def span(self, name: str) -> "_Span":
        """A context manager adding the seconds of its body to phase `name`."""
        return _Span(self, name)

    def sync(self) -> None:
        """Wait for the device's queued work (no-op on numpy), so a clock read means done."""
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The seconds summed so far, and start again from nothing."""
        out, self.seconds = self.seconds, {}
        return out


class _Span:
    __slots__ = ("clock", "name", "t0")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self.clock, self.name, self.t0 = clock, name, 0.0

    def __enter__(self) -> None:
        self.clock.sync()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock.sync()
        self.clock.add(self.name, time.perf_counter() - self.t0)
