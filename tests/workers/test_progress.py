"""The worker's progress heartbeat: it beats while the main thread computes (marks or CPU time,
also inside one long call that makes no mark) and stops beating while the main thread is
blocked, so a stuck worker is still found hung."""
from __future__ import annotations

import threading
import time

import numpy as np

from kvrt.workers.progress import Progress, ProgressBeat

PERIOD = 0.02


def _beats_during(work, seconds: float = 0.3) -> int:
    """Beats the helper gives while the main thread runs `work` for `seconds` (the first look
    after the helper starts counts nothing)."""
    beats = []
    progress = Progress()
    beater = ProgressBeat(progress, lambda: beats.append(1), PERIOD, slow_after_s=60).start()
    try:
        work(progress, seconds)
    finally:
        beater.close()
    return len(beats)


def _compute_without_marks(progress: Progress, seconds: float) -> None:
    a = np.random.default_rng(0).standard_normal((200, 200))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = np.tanh(a @ a)


def _mark_while_sleeping(progress: Progress, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        progress.mark()
        time.sleep(PERIOD / 4)


def _blocked(progress: Progress, seconds: float) -> None:
    threading.Event().wait(seconds)  # a wait that makes no progress, as a deadlock


def test_beats_while_the_main_thread_computes_without_marks():
    assert _beats_during(_compute_without_marks) >= 3


def test_beats_while_the_main_thread_marks_progress():
    assert _beats_during(_mark_while_sleeping) >= 3


def test_no_beat_while_the_main_thread_is_blocked():
    assert _beats_during(_blocked) == 0
