"""The waiting queue of the scheduler: first in, first out per owner, round-robin across owners.

Why: one queue in arrival order lets one client's burst (hundreds of requests, or streams it
never reads) sit ahead of every later request of every other client, which then waits for the
whole burst to be served. Here each owner (a request's quota key: its client socket, or the
HTTP client it was sent on behalf of) has its own queue, and the head of the whole queue is the
head of the owner whose turn it is; taking it passes the turn to the next owner. With one owner
it is exactly a deque.

What the scheduler asks of its queue keeps its meaning: `[0]` is who is admitted next,
`popleft` admits it, `appendleft` puts a request back first of all (a preempted one, or one
whose grammar or cached prefix became ready: a sequence holding a swapped-in match must be
admitted before another takes its room): first of its owner's queue, and its owner's turn
first. Iteration goes in the order requests would be taken. (An owner seated ahead of its turn
is the scheduler's business: runtime/engine/scheduler.py's newcomers.)
"""
from __future__ import annotations

from collections import deque
from typing import Iterator, Protocol


class Owned(Protocol):
    owner: bytes
    client: bytes


def owner_of(item: Owned) -> bytes:
    """Whose share a request counts against: its owner, else its client socket."""
    return item.owner or item.client


class FairQueue:
    """Round-robin over owners, FIFO within one (see the module docstring)."""

    def __init__(self) -> None:
        self._queues: dict[bytes, deque] = {}
        self._turns: deque[bytes] = deque()  # owners with something waiting, whose turn is first
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __getitem__(self, index: int):
        if index != 0 or not self._len:
            raise IndexError("only the head of a FairQueue can be read")
        return self._queues[self._turns[0]][0]

    def __iter__(self) -> Iterator:
        """The requests in the order they would be taken (a round over the owners' heads, then
        over their second requests, and so on)."""
        queues = [self._queues[o] for o in self._turns]
        for i in range(max((len(q) for q in queues), default=0)):
            for q in queues:
                if i < len(q):
                    yield q[i]

    def owners(self) -> list[bytes]:
        """The owners with requests waiting, whose turn is first."""
        return list(self._turns)

    def head_of(self, owner: bytes):
        """The first waiting request of `owner` (KeyError when it has none)."""
        return self._queues[owner][0]

    def append(self, item) -> None:
        owner = owner_of(item)
        q = self._queues.get(owner)
        if q is None:
            q = self._queues[owner] = deque()
            self._turns.append(owner)
        q.append(item)
        self._len += 1

    def appendleft(self, item) -> None:
        """`item` first of all: first of its owner's queue, and its owner's turn first."""
        owner = owner_of(item)
        q = self._queues.get(owner)
        if q is None:
            q = self._queues[owner] = deque()
        else:
            self._turns.remove(owner)
        self._turns.appendleft(owner)
        q.appendleft(item)
        self._len += 1

    def popleft(self):
        """Take the head; its owner's turn passes to the next owner."""
        if not self._len:
            raise IndexError("pop from an empty FairQueue")
        owner = self._turns.popleft()
        item = self._take(owner)
        if owner in self._queues:
            self._turns.append(owner)
        return item

    def pop_owner(self, owner: bytes):
        """Take `owner`'s first request out of turn (the other owners keep their order)."""
        item = self._take(owner)
        if owner not in self._queues:
            self._turns.remove(owner)
        return item

    def remove(self, item) -> None:
        owner = owner_of(item)
        q = self._queues[owner]
        q.remove(item)  # (ValueError when it is not there, as a deque's)
        self._len -= 1
        if not q:
            del self._queues[owner]
            self._turns.remove(owner)

    def _take(self, owner: bytes):
        q = self._queues[owner]
        item = q.popleft()
        self._len -= 1
        if not q:
            del self._queues[owner]
        return item
