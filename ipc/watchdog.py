"""How long something watched has made no progress, counted in the watcher's own running time.

Why not the age of a heartbeat: a node paused whole (every process SIGSTOPped, as a VM pause or
`docker pause` does) resumes with every heartbeat old although nothing hung. The watched
processes could not beat because they were not running, and neither was the watcher; whichever
of them is resumed first then reads an age that is only the length of the pause.

So a watcher keeps, per watched thing, the last value it saw (a heartbeat, an answer count, a
step id) and how much of its own running time has passed since that value changed. A gap
between two of its rounds much longer than its loop's period means the watcher itself was not
running: that gap does not count, and every watched thing gets a full timeout of running time
from then on, because the watched processes may be resumed after the watcher and need their
own running time to beat again. A process stopped alone keeps its value still while the watcher
goes on running, and so still counts as hung once the timeout has passed.
"""
from __future__ import annotations

import time
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


def pause_gap(timeout_s: float, poll_s: float) -> float:
    """The shortest gap between two rounds of a watcher that counts as a pause of it.

    Half the timeout: a whole-node pause just shorter than this still counts in full, and the
    watched thing's own silence around it (up to a beat period on each side) must not add up to
    the timeout. At least two poll periods: a watcher whose every round took longer than this
    would take each round for a pause and never call anything hung."""
    return max(timeout_s / 2, 2 * poll_s)


class Watchdog(Generic[K]):
    """Per key, the watcher's running seconds since the key's value last changed.

    Call `tick()` once per round of the watcher's loop, then `observe()` each watched value."""

    def __init__(self, pause_after_s: float, clock: Callable[[], float] = time.monotonic):
        if not pause_after_s > 0:
            raise ValueError(f"a watchdog's pause gap must be positive, got {pause_after_s}")
        self.pause_after_s = pause_after_s
        self._clock = clock
        self._last: float | None = None  # the clock at the previous round
        self._running = 0.0              # the watcher's running seconds, pauses left out
        self._seen: dict[K, object] = {}
        self._since: dict[K, float] = {}  # running time at which each value was last seen to change

    def tick(self) -> float:
        """Start a round: count the time since the last round as running time, unless it was a
        pause (then each key's silence starts again from zero). Returns the pause's length in
        seconds, 0.0 when there was none."""
        now = self._clock()
        gap = 0.0 if self._last is None else now - self._last
        self._last = now
        if gap > self.pause_after_s:
            for key in self._since:
                self._since[key] = self._running
            return gap
        self._running += max(gap, 0.0)
        return 0.0

    def observe(self, key: K, value: object) -> float:
        """Record `key`'s current value; the watcher's running seconds since it last changed
        (0.0 the first time the key is seen)."""
        if key not in self._seen or self._seen[key] != value:
            self._seen[key] = value
            self._since[key] = self._running
        return self._running - self._since[key]
