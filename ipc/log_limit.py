"""Warnings of one kind at most once per interval, with a count of those held back.

Why: much of what a node logs at WARNING answers what others send it (a refused peer message, a
malformed request, a client that stops reading, a KV events subscriber that does not keep up,
an invalid HTTP request), so a flood of bad input became a flood of log lines that filled the
disk and buried everything else. A filter on the process's log handlers lets each kind of
warning (its logger, level and message template) out once per interval; the next one let out
after the interval says how many were held back ("... [and 41 more like it in the last 10 s]").
Only WARNING is limited: an ERROR says something is wrong with the node itself (an ownership
violation, a failed stream), which no amount of bad input should hide.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

INTERVAL_S = 10.0
MAX_KINDS = 1024  # kinds tracked at once (a message formatted before logging makes a kind per value)


class RateLimit(logging.Filter):
    """A handler filter: each kind of WARNING record at most once per `interval_s`."""

    def __init__(self, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._kinds: dict[tuple, list] = {}  # kind -> [when the next may go out, held back since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        kind = (record.name, record.levelno, record.msg if isinstance(record.msg, str) else type(record.msg).__name__)
        now = self._clock()
        with self._lock:
            state = self._kinds.get(kind)
            if state is not None and now < state[0]:
                state[1] += 1
                return False
            if state is None and len(self._kinds) >= MAX_KINDS:
                self._kinds = {k: s for k, s in self._kinds.items() if now < s[0] or s[1]}
                if len(self._kinds) >= MAX_KINDS:
                    kind = ("", record.levelno, "(too many kinds)")  # one budget for all the rest
                    state = self._kinds.get(kind)
                    if state is not None and now < state[0]:
                        state[1] += 1
                        return False
            held = state[1] if state is not None else 0
            self._kinds[kind] = [now + self.interval_s, 0]
        if held:
            record.msg = f"{record.getMessage()} [and {held} more like it in the last {self.interval_s:g} s]"
            record.args = None
        return True


def limit_logs(logger: logging.Logger | None = None, interval_s: float = INTERVAL_S) -> None:
    """Put one RateLimit on each handler of `logger` (the root logger's by default) that has none."""
    for h in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RateLimit) for f in h.filters):
            h.addFilter(RateLimit(interval_s))
