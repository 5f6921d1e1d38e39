"""How the router passes a node's event stream on, so that a cut stream is never taken for a whole one.

A node ends a whole answer with `data: [DONE]`, and one it failed with an error event. Once the
status 200 went out with the first byte, a stream that ends any other way (the connection
dropped, a read failed, the body just stopped) would read as finished to a client: the router
then ends it with an error event of its own and no `[DONE]` (the openai client raises on it).
Events are passed on whole, so that this error event never lands inside a half-sent one. An
event that is not what a node sends (its data neither `[DONE]` nor a JSON object with `choices`
or `error`) is junk: it is not passed on, and the stream ends there with an error event.
"""
from __future__ import annotations

import json
import re

from kvrt.ipc import json_bounds

# an event ends at a blank line; the node writes "\n", other servers may write "\r\n"
_EVENT_END = re.compile(rb"\r?\n\r?\n")
MAX_EVENT_BYTES = 4 << 20  # the longest event held whole, unless the router says longer (its nodes' model length)
_DONE, _ERROR, _DATA, _JUNK = "done", "error", "data", "junk"


class EventRelay:
    """Cuts a byte stream into whole server-sent events and remembers what the last one was."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._pending = b""
        self._last = ""
        self.junk = ""  # the first junk event, shown

    @property
    def finished(self) -> bool:
        """The events so far end as a node ends an answer: `[DONE]`, or an error event."""
        return self._last in (_DONE, _ERROR)

    def feed(self, chunk: bytes) -> bytes:
        """The whole events that `chunk` completes (b"" while the current one is still open),
        up to the first junk event (then `junk` says what it was, and nothing more is taken)."""
        if self.junk:
            return b""
        buf = self._pending + chunk
        ends = list(_EVENT_END.finditer(buf, max(len(self._pending) - 3, 0)))  # an end may straddle chunks
        if not ends:
            self._pending = buf
            if len(buf) > self.max_event_bytes:  # no node sends one this long: not held without bound
                self.junk, self._pending = f"an event longer than {self.max_event_bytes} bytes: {buf[:60]!r}", b""
            return b""
        self._pending = buf[ends[-1].end():]
        start = 0
        for end in ends:
            event = buf[start:end.start()]
            kind = _kind(event)
            if kind == _JUNK:
                self.junk = f"{event[:100]!r}"
                self._pending = b""
                return buf[:start]
            if kind:
                self._last = kind
            start = end.end()
        return buf[:start]


def _kind(event: bytes) -> str:
    """What one event is by its first data line, as the openai client reads it: `[DONE]`, an
    error (a JSON object with an "error"), a chunk (one with "choices"), else junk ("" for an
    event without data: a comment)."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:].strip()
            if value == b"[DONE]":
                return _DONE
            try:
                obj = json_bounds.loads(value, MAX_EVENT_BYTES)
            except ValueError:
                return _JUNK
            if not isinstance(obj, dict):
                return _JUNK
            return _ERROR if obj.get("error") else _DATA if isinstance(obj.get("choices"), list) else _JUNK
    return ""


def error_event(message: str, code: str = "backend_broke_off") -> bytes:
    """An error event in the node's shape, with a code that says what the router's backend did."""
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode()
