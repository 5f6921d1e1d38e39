"""Broadcast: one order to every rank, then every rank's answer, with one deadline.

Every cache-transfer rank must see every task (ARCHITECTURE.md §2), so a broadcast is one
SPSC ring per rank out and one per rank back. `gather` names the ranks that did not answer,
so a dead or stuck rank fails the request instead of hanging the engine.
"""
from __future__ import annotations

import time
from typing import Sequence

from .errors import WaitTimeout
from .ring import Consumer, Producer


class Broadcast:
    def __init__(self, out: Sequence[Producer], back: Sequence[Consumer]):
        if len(out) != len(back):
            raise ValueError(f"broadcast needs one answer ring per rank ({len(out)} out, {len(back)} back)")
        self.out = list(out)
        self.back = list(back)

    def put(self, data: bytes, timeout: float) -> None:
        """Send `data` to every rank (each ring may wait while full)."""
        deadline = time.monotonic() + timeout
        for p in self.out:
            p.put(data, max(deadline - time.monotonic(), 0.0))

    def gather(self, timeout: float) -> list[bytes]:
        """One answer from every rank, in rank order; WaitTimeout names the missing ranks."""
        deadline = time.monotonic() + timeout
        answers: list[bytes | None] = [None] * len(self.back)
        for rank, c in enumerate(self.back):
            try:
                answers[rank] = c.get(max(deadline - time.monotonic(), 0.0))
            except WaitTimeout:
                for r in range(rank + 1, len(self.back)):
                    answers[r] = self.back[r].try_get()
                missing = [r for r, a in enumerate(answers) if a is None]
                raise WaitTimeout(f"broadcast: no answer within {timeout:.3g}s from rank(s) "
                                  f"{missing} (rings {[self.back[r].name for r in missing]})") from None
        return answers

    def request(self, data: bytes, timeout: float) -> list[bytes]:
        """put + gather under one deadline."""
        deadline = time.monotonic() + timeout
        self.put(data, timeout)
        return self.gather(max(deadline - time.monotonic(), 0.0))
