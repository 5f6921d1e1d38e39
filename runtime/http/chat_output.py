"""One chat answer's text as the OpenAI chat API shows it: `content`, and with the parsers on,
`reasoning_content` (runtime/http/reasoning.py) and `tool_calls` (runtime/http/tool_calls.py).

The text goes through the reasoning parser first and its content through the tool-call parser
(a call is read in the answer, never in the thinking). A streamed answer and a whole one take
the same path, so the deltas of a stream join into the message of the same text.
"""
from __future__ import annotations

from typing import Callable

from kvrt.runtime.http.reasoning import ReasoningParser
from kvrt.runtime.http.tool_calls import ToolCallParser, new_call_id


class ChatOutput:
    """`tool_parser`: the format calls are read in (None: no calls are read); `reasoning`: split
    off `<think>` (`in_reasoning`: the prompt left the model inside it)."""

    def __init__(self, tool_parser: str | None = None, reasoning: bool = False, in_reasoning: bool = False,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.tools = ToolCallParser(tool_parser, new_id) if tool_parser else None
        self.reasoning = ReasoningParser(in_reasoning) if reasoning else None
        self.called = False  # a tool call was read

    def feed(self, text: str) -> list[dict]:
        """The deltas of a new piece of the answer (possibly none: text held back)."""
        return self._deltas(self.reasoning.feed(text) if self.reasoning else [(False, text)], last=False)

    def finish(self) -> list[dict]:
        """The deltas the end of the answer releases."""
        return self._deltas(self.reasoning.finish() if self.reasoning else [], last=True)

    def message(self, text: str) -> dict:
        """A whole answer as a message's fields (the parser is used up)."""
        content, reasoning, calls = [], [], {}
        for d in self.feed(text) + self.finish():
            content.append(d.get("content", ""))
            reasoning.append(d.get("reasoning_content", ""))
            for c in d.get("tool_calls", []):
                if "id" in c:
                    calls[c["index"]] = {"id": c["id"], "type": "function", "function": dict(c["function"])}
                else:
                    calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        msg: dict = {"role": "assistant", "content": "".join(content)}
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(reasoning) or None
        if self.tools is not None:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
            if calls and not msg["content"]:
                msg["content"] = None
        return msg

    def _deltas(self, parts: list[tuple[bool, str]], last: bool) -> list[dict]:
        pieces: list = []
        for is_reasoning, text in parts:
            if is_reasoning:
                pieces.append(("reasoning_content", text))
            elif self.tools is None:
                pieces.append(("content", text))
            else:
                pieces.extend(self._tool_pieces(self.tools.feed(text)))
        if last and self.tools is not None:
            pieces.extend(self._tool_pieces(self.tools.finish()))
        return _merged(pieces)

    def _tool_pieces(self, pieces: list) -> list:
        out = []
        for p in pieces:
            if isinstance(p, str):
                out.append(("content", p))
            elif p.name is not None:
                self.called = True
                out.append(("call", {"index": p.index, "id": p.id, "type": "function",
                                     "function": {"name": p.name, "arguments": ""}}))
                if p.arguments:
                    out.append(("args", p))
            else:
                out.append(("args", p))
        return out


def _merged(pieces: list) -> list[dict]:
    """Deltas from pieces, neighbours of one kind (and one call) joined: a call's first delta
    stands alone, as vLLM sends it."""
    out: list[dict] = []
    last = None
    for kind, value in pieces:
        if kind == "args":
            if last == ("args", value.index):
                out[-1]["tool_calls"][0]["function"]["arguments"] += value.arguments
            else:
                out.append({"tool_calls": [{"index": value.index, "function": {"arguments": value.arguments}}]})
            last = ("args", value.index)
        elif kind == "call":
            out.append({"tool_calls": [value]})
            last = ("call", value["index"])
        else:
            if last == (kind, None):
                out[-1][kind] += value
            else:
                out.append({kind: value})
            last = (kind, None)
    return out

