"""A large JSON answer written as it is made, never held whole.

Why: an answer with log-probabilities holds an object per token and alternative; built whole
(as a dict, then one string) a request of a few prompts scored with twenty alternatives each
took hundreds of MiB of JSON and gigabytes of objects in the server, and seconds of its event
loop. Here the answer's large lists are `Lazy`: their items are made while the answer is
written, a slice of about SLICE characters at a time, and between two slices the event loop
serves everyone else. What is written is exactly `json.dumps` of the answer with its lazy lists
made whole, in the compact form Starlette's JSONResponse writes (no spaces, UTF-8 as it is).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Iterable, Iterator

SLICE = 1 << 16  # characters written between two turns of the event loop


BATCH = 256      # plain items of a Lazy list written with one json.dumps


class Lazy:
    """A JSON array whose items are made while it is written (`items` is iterated once).
    `plain`: its items hold no Lazy list (they are then written BATCH at a time)."""

    def __init__(self, items: Iterable[Any], plain: bool = True) -> None:
        self.items = items
        self.plain = plain

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)


def dumps(obj: Any) -> str:
    """`obj` (no Lazy inside) as Starlette's JSONResponse writes it."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def materialize(obj: Any) -> Any:
    """`obj` with its Lazy lists made whole (for small answers, and for tests)."""
    if isinstance(obj, Lazy):
        return [materialize(x) for x in obj]
    if isinstance(obj, dict):
        return {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [materialize(x) for x in obj]
    return obj


async def json_pieces(obj: Any, slice_chars: int = SLICE) -> AsyncIterator[str]:
    """`obj`'s JSON in pieces of about `slice_chars` characters, yielding to the event loop
    between them."""
    out: list[str] = []
    size = 0
    for piece in _pieces(obj):
        out.append(piece)
        size += len(piece)
        if size >= slice_chars:
            yield "".join(out)
            out, size = [], 0
            await asyncio.sleep(0)
    if out:
        yield "".join(out)


def _pieces(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        if not any(_lazy_inside(v) for v in obj.values()):
            yield dumps(obj)
            return
        yield "{"
        for i, (k, v) in enumerate(obj.items()):
            yield ("," if i else "") + dumps(str(k)) + ":"
            yield from _pieces(v)
        yield "}"
    elif isinstance(obj, Lazy) and obj.plain:
        yield "["
        first, batch = True, []
        for v in obj:
            batch.append(v)
            if len(batch) >= BATCH:
                yield ("" if first else ",") + dumps(batch)[1:-1]
                first, batch = False, []
        if batch:
            yield ("" if first else ",") + dumps(batch)[1:-1]
        yield "]"
    elif isinstance(obj, Lazy) or (isinstance(obj, (list, tuple)) and any(_lazy_inside(v) for v in obj)):
        yield "["
        for i, v in enumerate(obj):
            if i:
                yield ","
            yield from _pieces(v)
        yield "]"
    else:
        yield dumps(obj)


def _lazy_inside(obj: Any) -> bool:
    if isinstance(obj, Lazy):
        return True
    if isinstance(obj, dict):
        return any(_lazy_inside(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(isinstance(v, (Lazy, dict, list, tuple)) and _lazy_inside(v) for v in obj)
    return False
