"""`--reasoning-parser qwen3`: a thinking model's `<think>...</think>` apart from its answer, as
vLLM's `reasoning_content`.

The reasoning is what the answer opens with between `<think>` and `</think>`; when the prompt
itself ends in `<think>` (templates that open the thinking for the model), the answer starts
inside it. An answer that does not open with `<think>` is all content; one that never closes
it is all reasoning (it ran out of tokens while thinking). Whitespace between `</think>` and
the answer is dropped. Like the tool-call parser, it is fed in pieces and what it emits depends
only on the text so far, so streamed deltas join into the message the whole text gives.
"""
from __future__ import annotations

from kvrt.runtime.http.tool_calls import held_back

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3",)
_WS = " \t\r\n"


class ReasoningParser:
    """One answer's text -> (is_reasoning, text) pieces."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.state = "reason" if in_reasoning else "start"
        self.buf = ""
        self.out: list[tuple[bool, str]] = []

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self.buf += text
        while self._step():
            pass
        out, self.out = self.out, []
        return out

    def finish(self) -> list[tuple[bool, str]]:
        self.feed("")
        if self.buf and self.state in ("start", "reason"):
            self.out.append((self.state == "reason", self.buf))
        self.buf = ""
        out, self.out = self.out, []
        return out

    def _emit(self, reasoning: bool, text: str) -> None:
        if text:
            self.out.append((reasoning, text))

    def _step(self) -> bool:
        buf = self.buf
        if self.state == "start":
            s = buf.lstrip(_WS)
            if s.startswith(OPEN):
                self.buf, self.state = s[len(OPEN):], "reason"
                return True
            if OPEN.startswith(s):
                return False
            self.state = "content"
            return True
        if self.state == "reason":
            i = buf.find(CLOSE)
            if i >= 0:
                self._emit(True, buf[:i])
                self.buf, self.state = buf[i + len(CLOSE):], "answer"
                return True
            k = held_back(buf, CLOSE)
            self._emit(True, buf[:len(buf) - k])
            self.buf = buf[len(buf) - k:]
            return False
        if self.state == "answer":  # whitespace after </think>
            self.buf = buf.lstrip(_WS)
            if not self.buf:
                return False
            self.state = "content"
            return True
        self._emit(False, buf)
        self.buf = ""
        return False


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the model inside `<think>`."""
    tail = prompt_text.rstrip(_WS)
    return tail.endswith(OPEN)
