"""Fan-in: one consumer reading several SPSC rings fairly (a many-to-one edge is one ring per
producer: a ring has exactly one producer, so it needs no lock).

Fairness: each `get` starts scanning after the ring served last, so one busy producer cannot
starve the others. Sleeping: the rings are created with one shared doorbell, so the consumer
announces sleep on every ring and blocks on that single semaphore; whichever producer
publishes first wakes it.

Waking from outside: `poke()` (from any thread of the consumer's process, e.g. a socket I/O
thread that queued work) makes the current or next `get` return None at once; it rings the
doorbell only while the consumer sleeps, so it costs nothing on a busy consumer.

Liveness: a producer that closed its ring has finished normally; a producer's death is reported once its ring is drained, at most every
`check_every` seconds even while other producers keep the consumer busy, as PeerDead with
`.index` naming the ring. A replacement producer can then attach and the fan-in goes on.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

from kvrt.ipc.errors import PeerDead, WaitTimeout
from kvrt.ipc.ring import SLICE_S, SPINS, YIELDS, Consumer


class FanIn:
    def __init__(self, consumers: Sequence[Consumer], check_every: float = 0.1):
        if not consumers:
            raise ValueError("FanIn needs at least one ring")
        bells = {c.doorbell.name for c in consumers}
        if len(bells) != 1:
            raise ValueError(f"FanIn rings must share one doorbell, got {sorted(bells)}")
        self.consumers = list(consumers)
        self._bell = consumers[0].doorbell
        self._next = 0
        self._check_every = check_every
        self._next_check = time.monotonic() + check_every
        self._reported: dict[int, int] = {}  # ring index -> dead producer pid already reported
        self._poked = False
        self._sleeping = False
        self.spin_s = 0.0  # as a ring end's: seconds a wait spins by the clock before it yields

    def poke(self) -> None:
        """Make `get` return None now (thread-safe: a flag, then a ring if the reader sleeps)."""
        self._poked = True
        if self._sleeping:
            self._bell.ring()

    def try_get(self) -> tuple[int, bytes] | None:
        """(ring index, record) from the next non-empty ring in round-robin order, or None."""
        n = len(self.consumers)
        start = self._next
        for k in range(n):
            i = (start + k) % n
            rec = self.consumers[i].try_get()
            if rec is not None:
                self._next = (i + 1) % n
                return i, rec
        return None

    def _check_peers(self) -> None:
        self._next_check = time.monotonic() + self._check_every
        for i, c in enumerate(self.consumers):
            pid = c.producer_pid
            if self._reported.get(i) == pid or c.closed or c.producer_alive():
                continue
            if c.pending():
                continue  # report only once its records are drained
            self._reported[i] = pid
            err = PeerDead(f"ring {c.name}: producer (pid {pid}) is dead")
            err.index = i
            raise err

    def get(self, timeout: float) -> tuple[int, bytes] | None:
        """Wait up to `timeout` s for a record from any ring; returns (ring index, record), or
        None when poked."""
        if self._poked:
            self._poked = False
            return None
        if time.monotonic() >= self._next_check:
            self._check_peers()
        for _ in range(SPINS // 4):
            got = self.try_get()
            if got is not None:
                return got
        deadline = time.perf_counter() + self.spin_s
        while time.perf_counter() < deadline:
            if self._poked:
                self._poked = False
                return None
            got = self.try_get()
            if got is not None:
                return got
        for _ in range(YIELDS):
            os.sched_yield()
            got = self.try_get()
            if got is not None:
                return got
        deadline = time.monotonic() + timeout
        while True:
            self._sleeping = True
            for c in self.consumers:
                c.set_sleeping(True)
            got = self.try_get()
            if got is None and self._poked:
                self._poked = False
                self._wake_all()
                return None
            if got is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._wake_all()
                    raise WaitTimeout(f"fan-in over {len(self.consumers)} rings: timed out after "
                                      f"{timeout:.3g}s waiting for a record from any producer")
                self._bell.wait(min(left, SLICE_S))
                got = self.try_get()
            self._wake_all()
            if got is not None:
                return got
            self._check_peers()

    def _wake_all(self) -> None:
        self._sleeping = False
        for c in self.consumers:
            c.set_sleeping(False)
