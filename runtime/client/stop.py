"""Stop strings: end an answer at the first occurrence of any of a few strings in its text.

Why here and not in the engine: a stop string is text, and the engine sees token ids only. The
text is known where the output is detokenized (the client, or an HTTP layer), so that side scans
it, truncates the answer before the stop string, and cancels the request. Streaming makes one
thing subtle: a stop string can arrive split over several pieces of text, so a piece's tail
that could still become a stop string is held back until the next piece decides it.
"""
from __future__ import annotations

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def stop_problem(stops: object) -> str:
    """What is wrong with a list of stop strings, or "" (checked before any text is scanned)."""
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOP_STRINGS:
        return f"stop must be a list of at most {MAX_STOP_STRINGS} strings, got {type(stops).__name__}"
    for s in stops:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            return f"each stop string must be a non-empty string of at most {MAX_STOP_CHARS} characters, got {s!r:.60}"
    return ""


class StopStrings:
    """Scans streamed text. `feed` returns the text that may be shown now; once a stop string
    is seen, `stopped` holds it and no more text comes out (the stop string itself is not
    shown unless `include`). `flush` at the end of the stream returns what was held back."""

    def __init__(self, stops: list[str] | tuple[str, ...], include: bool = False) -> None:
        if problem := stop_problem(stops):
            raise ValueError(problem)
        self.stops = list(stops)
        self.include = include
        self.stopped: str | None = None
        self._held = ""

    def feed(self, piece: str, check: bool = True) -> str:
        """The text of `piece` that may be shown now. `check` False: the piece is shown whole
        and not scanned (text before a request's min_tokens cannot stop it)."""
        if self.stopped is not None:
            return ""
        text = self._held + piece
        if not check:
            self._held = ""
            return text
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            at, self.stopped = min(found, key=lambda f: f[0])
            self._held = ""
            return text[:at + len(self.stopped)] if self.include else text[:at]
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped is not None else held
