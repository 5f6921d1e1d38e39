"""A request body parsed off the event loop (runtime/http/request_body.py): JSON that does not
parse or nests past the parser is a 400, what asks more text work than the model's length
allows (text, ids, messages) is a 400 naming the field and the limit before validation, and
anything else validates as FastAPI would validate it (the same model, the same errors)."""
from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError

from kvrt.runtime.http.errors import ApiError
from kvrt.runtime.http.openai_schema import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvrt.runtime.http.request_body import parse
from kvrt.runtime.http.text_limits import max_text_chars

LEN = 64
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("raw", [b"[" * 100_000, b"{", b"not json", b'{"prompt": "a"'])
def test_what_is_not_json_is_a_400(raw):
    with pytest.raises(ApiError) as e:
        parse(raw, CompletionRequest, LEN)
    assert e.value.status == 400 and e.value.param == "body"


@pytest.mark.parametrize("model, body, field", [
    (CompletionRequest, {"prompt": "x" * (max_text_chars(LEN) + 1)}, "prompt"),
    (CompletionRequest, {"prompt": ["a", "x" * (max_text_chars(LEN) + 1)]}, "prompt"),
    (CompletionRequest, {"prompt": [1] * (LEN + 1)}, "prompt"),
    (CompletionRequest, {"prompt": [[1], [1] * (LEN + 1)]}, "prompt"),
    (DetokenizeRequest, {"tokens": [1] * (LEN + 1)}, "tokens"),
    (ChatRequest, {"messages": [USER] * (LEN + 1)}, "messages"),
    (ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * max_text_chars(LEN)}]},
                                USER]}, "messages"),
    (TokenizeRequest, {"prompt": "x" * (max_text_chars(LEN) + 1)}, "prompt"),
])
def test_text_work_past_the_models_length_is_refused_naming_the_field(model, body, field):
    with pytest.raises(ApiError) as e:
        parse(json.dumps(body).encode(), model, LEN)
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "context_length_exceeded")
    assert str(LEN) in e.value.message


@pytest.mark.parametrize("model, body", [
    (CompletionRequest, {"prompt": "x" * max_text_chars(LEN), "n": 2}),
    (CompletionRequest, {"prompt": [[1] * LEN, [2]]}),
    (ChatRequest, {"messages": [USER] * LEN, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    (DetokenizeRequest, {"tokens": [1] * LEN}),
])
def test_a_body_within_the_limits_validates_as_its_model(model, body):
    assert parse(json.dumps(body).encode(), model, LEN) == model.model_validate(body)


def test_an_invalid_body_is_fastapis_validation_error():
    with pytest.raises(RequestValidationError) as e:
        parse(b'{"prompt": [0.5], "n": 0}', CompletionRequest, LEN)
    locs = [err["loc"] for err in e.value.errors()]
    assert all(loc[0] == "body" for loc in locs) and ("body", "prompt") in locs
