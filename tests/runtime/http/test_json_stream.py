"""A large answer written as it is made (runtime/http/json_stream.py) is exactly the JSON of the
whole answer, as Starlette's JSONResponse writes it (the oracle: json.dumps of the answer made
whole), whatever its shape, wherever its lazy lists sit and however small the slices."""
from __future__ import annotations

import asyncio
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from kvrt.runtime.http.json_stream import BATCH, Lazy, json_pieces, materialize

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False, allow_infinity=False),
                     st.text(max_size=8))


def _values(depth: int = 3):
    if depth == 0:
        return _scalars
    inner = _values(depth - 1)
    return st.one_of(_scalars, st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4),
                     st.tuples(st.lists(inner, max_size=BATCH + 3), st.booleans()).map(
                         lambda t: Lazy(iter(t[0]), plain=t[1] and not any(isinstance(x, (Lazy, list, dict))
                                                                          for x in t[0]))))


def _written(obj, slice_chars: int) -> str:
    async def go() -> str:
        return "".join([piece async for piece in json_pieces(obj, slice_chars)])
    return asyncio.run(go())


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=5), _values(), max_size=5), st.sampled_from([1, 7, 1 << 16]))
def test_what_is_written_is_the_whole_answers_json(answer, slice_chars):
    def whole(o):  # (a Lazy list is iterated once: make the oracle from a copy taken first)
        if isinstance(o, Lazy):
            items = [whole(x) for x in o.items]
            o.items = items
            return items
        if isinstance(o, dict):
            return {k: whole(v) for k, v in o.items()}
        if isinstance(o, list):
            return [whole(x) for x in o]
        return o

    lazy_free = whole(answer)
    want = JSONResponse(lazy_free).body.decode()
    assert _written(answer, slice_chars) == want
    assert json.loads(want) == json.loads(json.dumps(materialize(answer)))


def test_a_lazy_list_is_made_only_while_it_is_written():
    made = []

    def items():
        for i in range(3 * BATCH):
            made.append(i)
            yield {"i": i}

    async def go() -> list[int]:
        seen = []
        async for _ in json_pieces({"a": Lazy(items())}, slice_chars=64):
            seen.append(len(made))
        return seen

    seen = asyncio.run(go())
    assert seen[0] < 3 * BATCH and seen[-1] == 3 * BATCH, "the list was made whole before the first piece"
