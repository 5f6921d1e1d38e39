"""One answer per rank before a deadline.

Every order the engine sends goes to every rank of a group (worker[r] for a step,
cache-messager[r] for a send), and the order is done only when each rank has answered. The
collection, the "who is still missing" and the deadline live here once, so each caller only
says what an answer means.
"""
from __future__ import annotations

import time
from typing import Generic, TypeVar

T = TypeVar("T")


class RankGroup(Generic[T]):
    """Answers of ranks 0..size-1 to one order, due by `deadline` (time.monotonic)."""

    def __init__(self, size: int, deadline: float):
        if size <= 0:
            raise ValueError(f"a rank group needs at least one rank, got {size}")
        self.size = size
        self.deadline = deadline
        self._answers: dict[int, T] = {}

    def add(self, rank: int, answer: T) -> bool:
        """Record `rank`'s answer (a repeated one replaces the first); True once every rank
        answered. A rank outside the group is a caller's bug, not an answer: ValueError."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a group of {self.size}")
        self._answers[rank] = answer
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self._answers) == self.size

    @property
    def answers(self) -> list[T]:
        """The answers so far, in rank order."""
        return [self._answers[r] for r in sorted(self._answers)]

    def missing(self) -> list[int]:
        """Ranks that have not answered yet."""
        return [r for r in range(self.size) if r not in self._answers]

    def expired(self, now: float | None = None) -> bool:
        """The deadline passed before every rank answered."""
        return not self.complete and (time.monotonic() if now is None else now) >= self.deadline
