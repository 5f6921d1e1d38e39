"""Stopping a process a benchmark started: SIGINT, a grace period for its clean stop, then SIGKILL.

Why SIGINT first: kvrt's processes (nodes, routers, stores) release their shared memory and
sockets on it; a kill leaves that to `kvrt clean`. The kill after the grace period keeps a
benchmark from hanging on a process that stopped answering."""
from __future__ import annotations

import signal
import subprocess

KILLED_WAIT_S = 10.0  # a killed process is reaped within this (the wait names no other cause)


def interrupt(proc: subprocess.Popen, grace_s: float) -> bool:
    """Stop `proc`: True if it exited by itself (before, or within `grace_s` of SIGINT), False if
    it had to be killed."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(KILLED_WAIT_S)
        return False
