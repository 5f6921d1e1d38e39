"""How the router passes a node's event stream on, so that a cut stream is never taken for a whole one.

A node ends a whole answer with `data: [DONE]`, and one it failed with an error event. Once the
status 200 went out with the first byte, a stream that ends any other way (the connection
dropped, a read failed, the body just stopped) would read as finished to a client: the router
then ends it with an error event of its own and no `[DONE]` (the openai client raises on it).
Events are passed on whole, so that this error event never lands inside a half-sent one.
"""
from __future__ import annotations

import json
import re

# an event ends at a blank line; the node writes "\n", other servers may write "\r\n"
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_DONE, _ERROR, _DATA = "done", "error", "data"


class EventRelay:
    """Cuts a byte stream into whole server-sent events and remembers what the last one was."""

    def __init__(self) -> None:
        self._pending = b""
        self._last = ""

    @property
    def finished(self) -> bool:
        """The events so far end as a node ends an answer: `[DONE]`, or an error event."""
        return self._last in (_DONE, _ERROR)

    def feed(self, chunk: bytes) -> bytes:
        """The whole events that `chunk` completes (b"" while the current one is still open)."""
        buf = self._pending + chunk
        ends = list(_EVENT_END.finditer(buf, max(len(self._pending) - 3, 0)))  # an end may straddle chunks
        if not ends:
            self._pending = buf
            return b""
        self._pending = buf[ends[-1].end():]
        starts = [0] + [m.end() for m in ends[:-1]]
        for start, end in zip(reversed(starts), reversed(ends)):
            kind = _kind(buf[start:end.start()])
            if kind:
                self._last = kind
                break
        return buf[:ends[-1].end()]


def _kind(event: bytes) -> str:
    """What one event is by its first data line, as the openai client reads it: an error when
    its data is a JSON object with an "error" ("" for an event without data: a comment)."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:].strip()
            if value == b"[DONE]":
                return _DONE
            if b'"error"' not in value:
                return _DATA
            try:
                obj = json.loads(value)
            except ValueError:
                return _DATA
            return _ERROR if isinstance(obj, dict) and obj.get("error") else _DATA
    return ""


def error_event(message: str) -> bytes:
    """An error event in the node's shape, with the code that says the router's backend broke off."""
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": "backend_broke_off"}}
    return f"data: {json.dumps(body)}\n\n".encode()
