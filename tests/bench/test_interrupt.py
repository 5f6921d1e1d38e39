"""bench/interrupt.py: a process that stops on SIGINT is left to stop; one that ignores it is killed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvrt.bench.interrupt import interrupt

pytestmark = pytest.mark.e2e

SLEEPER = "import signal, sys, time; {}; sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"


def _start(ignore_sigint: bool) -> subprocess.Popen:
    setup = "signal.signal(signal.SIGINT, signal.SIG_IGN)" if ignore_sigint else "pass"
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER.format(setup)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"  # (its handler is set before SIGINT comes)
    return proc


def test_a_process_that_stops_on_sigint_is_not_killed():
    proc = _start(ignore_sigint=False)
    assert interrupt(proc, 10) is True
    assert proc.returncode != -9


def test_a_process_that_ignores_sigint_is_killed_after_the_grace_period():
    proc = _start(ignore_sigint=True)
    assert interrupt(proc, 0.5) is False
    assert proc.returncode == -9


def test_a_process_already_gone_is_left_alone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    assert interrupt(proc, 0.5) is True
