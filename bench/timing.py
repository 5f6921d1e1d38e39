"""Timing one call the way every kvrt benchmark does: the best of several runs.

Why the best and not the mean: on a shared machine noise only ever slows a call down, so the
fastest run is the closest to what the code itself costs."""
from __future__ import annotations

import time
from typing import Any, Callable


def best_seconds(fn: Callable[[], Any], repeat: int, warm: bool = True) -> float:
    """Best of `repeat` timed calls of `fn`, after one untimed warm-up call unless `warm` is
    False (a call too slow to make twice)."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
