"""A child process that must not outlive the process that started it.

Why the kernel does it: a parent killed with SIGKILL runs no cleanup, so only a death signal the
kernel sends (Linux's PR_SET_PDEATHSIG) reaches children it can no longer stop itself: a node's
processes when the launcher dies, a Mooncake master when `kvrt store start` dies."""
from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM to this process when its parent dies: a `preexec_fn`, run in the child between
    fork and exec (the setting survives exec)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
