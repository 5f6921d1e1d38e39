"""What a refused body costs the HTTP server: a long list of the wrong type is one error, not one
per element (a 5 MiB body of them built millions of errors and hundreds of MiB), and a refused
body's objects are freed when its answer is sent, not kept by a cycle through a validator's
exception until a full garbage collection (eight such bodies grew a node's server by 400 MiB)."""
from __future__ import annotations

import gc

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from kvrt.runtime.http.app import Server, create_app
from kvrt.runtime.http.openai_schema import ChatRequest, CompletionRequest, DetokenizeRequest
from tests.runtime.http.test_http import MODEL, _FakeBridge

N = 200_000
TEXT = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("model, body", [
    (CompletionRequest, {"prompt": [0.5] * N}),
    (CompletionRequest, {"prompt": [[1, 2]] * N + [[0.5]]}),
    (CompletionRequest, {"prompt": [True] * N}),
    (CompletionRequest, {"prompt": "a", "stop": [0] * N}),
    (CompletionRequest, {"prompt": "a", "stop_token_ids": [0.5] * N}),
    (ChatRequest, {"messages": [0] * N}),
    (ChatRequest, {"messages": [{"role": "user", "content": [0] * N}]}),
    (ChatRequest, {"messages": [TEXT], "tools": [0] * N}),
    (DetokenizeRequest, {"tokens": [0.5] * N}),
])
def test_a_long_list_of_the_wrong_type_is_one_error(model, body):
    with pytest.raises(ValidationError) as e:
        model.model_validate({"model": MODEL, **body})
    assert e.value.error_count() <= 2  # (one per member of a union that is a list)


@pytest.mark.parametrize("prompt", ["a", ["a", "b"], [1, 2], [[1, 2], [3]], []])
def test_every_prompt_shape_is_still_taken(prompt):
    assert CompletionRequest.model_validate({"model": MODEL, "prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("item, extra", [("0.5", ""), ("0", ', "cache_salt": ""')])
def test_a_refused_bodys_objects_are_freed_with_its_answer(item, extra):
    app = create_app(Server(_FakeBridge(True), MODEL))
    n = N + 7  # (a length no other list here has)
    body = f'{{"model": "{MODEL}", "max_tokens": 1{extra}, "prompt": [{", ".join([item] * n)}]}}'
    with TestClient(app) as c:
        c.get("/health")
        gc.collect()
        gc.disable()
        try:
            r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            left = [o for o in gc.get_objects() if type(o) is list and len(o) == n]
        finally:
            gc.enable()
    assert r.status_code == 400, r.text
    assert not left, "a refused body's prompt outlived its answer (held by a reference cycle)"
