"""A worker's liveness measured by progress, not by the silence of its main thread.

Why: the launcher calls a process hung once its heartbeat has stood still for --hang-timeout.
A worker's main thread beats between steps and after each layer, but one layer of a long
prefill (thousands of tokens in one step, on a CPU) can take longer than that, and a healthy
node was stopped in the middle of a step it was about to finish.

So a helper thread beats for the main thread while the main thread makes progress, and only
then. Progress is either of two things the helper can see without the main thread's help:
- its marks: a counter the model advances after each layer and each key tile of attention
  (cheap: an integer add);
- its CPU time (the main thread's own clock, CLOCK_THREAD_CPUTIME_ID): a single long matrix
  product makes no mark, but it runs on the main thread (the children's BLAS is
  single-threaded) and its CPU time grows.
A main thread that is stopped (SIGSTOP, a node paused whole), blocked (a deadlock, a wait that
never ends) or gone makes neither, so the helper stops beating and the launcher still calls it
hung within --hang-timeout. A main thread that spins forever inside a step keeps beating; the
engine's deadline for the step (which grows with the step's size) bounds that case.

The helper also logs a step that runs longer than the hang timeout, once, so a slow step is
visible in the log before anyone has to guess; the worker publishes which step it is in (its
PROCS row), and the launcher names that step when it calls the worker hung.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

MIN_CPU_S = 0.001  # CPU time the main thread must have used since the last look to count as running


class Progress:
    """The main thread's marks and the step it is in (written by the main thread only; a
    Python int assignment is atomic under the GIL, so the helper reads whole values)."""

    def __init__(self) -> None:
        self.marks = 0
        self.step = -1  # the step in progress, -1 between steps
        self.step_started = 0.0

    def mark(self) -> None:
        self.marks += 1

    def begin(self, step_id: int) -> None:
        self.step_started = time.monotonic()
        self.step = step_id

    def end(self) -> None:
        self.step = -1


class ProgressBeat:
    """Every `period_s`, calls `beat` if the main thread (the one that built this object) made
    progress since the last look (module docstring), and logs a step that runs longer than
    `slow_after_s` once."""

    def __init__(self, progress: Progress, beat: Callable[[], None], period_s: float, slow_after_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"a heartbeat period must be positive, got {period_s}")
        self.progress = progress
        self._beat = beat
        self.period_s = period_s
        self.slow_after_s = slow_after_s
        self._clock = time.pthread_getcpuclockid(threading.get_ident())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-beat", daemon=True)

    def start(self) -> "ProgressBeat":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.period_s + 1.0)

    def look(self, state: tuple[int, float]) -> tuple[bool, tuple[int, float]]:
        """(whether the main thread progressed since `state`, the state now)."""
        now = (self.progress.marks, time.clock_gettime(self._clock))
        return now[0] != state[0] or now[1] - state[1] >= MIN_CPU_S, now

    def _run(self) -> None:
        _, state = self.look((0, 0.0))
        told_slow = -1
        while not self._stop.wait(self.period_s):
            try:
                moved, state = self.look(state)
            except OSError:  # the main thread is gone: nothing to beat for
                return
            if moved:
                self._beat()
            p = self.progress
            step = p.step
            if step >= 0 and step != told_slow and time.monotonic() - p.step_started > self.slow_after_s:
                told_slow = step
                log.info("step %d has run for %.1fs (longer than the hang timeout); the worker is beating "
                         "while it makes progress", step, time.monotonic() - p.step_started)
