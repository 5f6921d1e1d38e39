"""The watchdog's rule on a fake clock: silence counts only the watcher's own running time, a
pause of the watcher gives every watched process a full timeout again, and a process stopped
alone while the watcher runs is still seen silent for as long as it is."""
from __future__ import annotations

import pytest

from kvrt.ipc.watchdog import Watchdog, pause_gap

POLL = 0.2
TIMEOUT = 1.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _rounds(dog: Watchdog, clock: FakeClock, seconds: float, beats: dict[str, int] | None = None,
            beating: tuple[str, ...] = ()) -> dict[str, float]:
    """Run the watcher's loop for `seconds` of its time, one round per POLL; the processes in
    `beating` beat once a round, the others stay still. The silences seen in the last round."""
    beats = beats if beats is not None else {}
    seen: dict[str, float] = {}
    for _ in range(round(seconds / POLL)):
        clock.t += POLL
        dog.tick()
        for name in beats:
            if name in beating:
                beats[name] += 1
            seen[name] = dog.observe(name, beats[name])
    return seen


def _dog() -> tuple[Watchdog, FakeClock]:
    clock = FakeClock()
    dog: Watchdog[str] = Watchdog(pause_gap(TIMEOUT, POLL), clock)
    dog.tick()
    return dog, clock


def test_a_beating_process_is_never_silent_and_a_still_one_is_silent_for_the_watchers_time():
    dog, clock = _dog()
    beats = {"engine": 1, "worker": 1}
    seen = _rounds(dog, clock, 3.0, beats, beating=("engine",))
    assert seen["engine"] == 0.0
    assert seen["worker"] == pytest.approx(3.0 - POLL)  # still since the first round saw it


def test_a_pause_of_the_watcher_alone_does_not_count():
    dog, clock = _dog()
    beats = {"worker": 1}
    assert _rounds(dog, clock, 0.6, beats)["worker"] == pytest.approx(0.4)
    clock.t += 30.0  # the watcher was stopped; the worker beat meanwhile
    beats["worker"] += 1
    assert dog.tick() == pytest.approx(30.0)
    assert dog.observe("worker", beats["worker"]) == 0.0


def test_a_whole_node_pause_gives_each_process_a_full_timeout_from_the_watchers_resume():
    dog, clock = _dog()
    beats = {"engine": 1, "worker": 1}
    _rounds(dog, clock, 0.8, beats)  # the processes were frozen first: 0.6 s of silence seen ...
    clock.t += 10 * TIMEOUT          # ... then the watcher too, far longer than the timeout
    assert dog.tick() > 0
    assert dog.observe("worker", beats["worker"]) == 0.0
    # resumed before the processes: they are still while it runs, but only its time after the
    # resume counts, so they have the whole timeout to beat again
    seen = _rounds(dog, clock, TIMEOUT - POLL, beats)
    assert seen["worker"] < TIMEOUT
    seen = _rounds(dog, clock, POLL, beats, beating=("engine", "worker"))
    assert seen == {"engine": 0.0, "worker": 0.0}


def test_a_process_stopped_alone_is_silent_past_the_timeout_also_across_a_pause_of_the_watcher():
    dog, clock = _dog()
    beats = {"engine": 1, "worker": 1}
    assert _rounds(dog, clock, 2 * TIMEOUT, beats, beating=("engine",))["worker"] > TIMEOUT
    clock.t += 10 * TIMEOUT  # the watcher is stopped and resumed; the worker stays stopped
    assert dog.tick() > 0
    seen = _rounds(dog, clock, TIMEOUT + 2 * POLL, beats, beating=("engine",))
    assert seen["worker"] > TIMEOUT and seen["engine"] == 0.0


def test_a_pause_of_the_watched_process_alone_counts_in_full():
    dog, clock = _dog()
    beats = {"worker": 1}
    seen = _rounds(dog, clock, 1.4, beats)  # the worker stopped while the watcher ran on
    assert seen["worker"] == pytest.approx(1.2)
    beats["worker"] += 1  # ... and was resumed
    assert _rounds(dog, clock, POLL, beats)["worker"] == 0.0


def test_a_gap_shorter_than_the_pause_gap_is_running_time():
    dog, clock = _dog()
    beats = {"worker": 1}
    _rounds(dog, clock, POLL, beats)
    clock.t += dog.pause_after_s  # a slow round, not a pause
    assert dog.tick() == 0.0
    assert dog.observe("worker", 1) == pytest.approx(dog.pause_after_s)


def test_the_pause_gap_is_below_the_timeout_and_above_the_poll_period():
    assert pause_gap(5.0, 0.2) == 2.5
    assert pause_gap(0.3, 0.2) == 0.4  # a round per poll is never taken for a pause
    with pytest.raises(ValueError):
        Watchdog(0.0)
