"""A request's JSON body, parsed and checked off the event loop, its text bounded first.

Why not FastAPI's own body parameter: FastAPI parses and validates a body on the event loop
before the handler runs, and a body under the size limit (runtime/http/body_limit.py) can still
take a second of it (a conversation of 160,000 short messages: half a second of validation in
a 5 MiB body; twelve MiB for a long model). Here a large body is parsed in the server's text
pool (runtime/http/text_pool.py), in its client's turn, and what the request hands the text
work is bounded by the model's length before validation (runtime/http/text_limits.py): the
prompts' text and token ids, the conversation's messages and their text, the ids to detokenize.

A body that is not JSON, or nested deeper than the parser goes, is a 400; so is one that does
not validate (FastAPI's RequestValidationError, which the app answers as it answers its own).
"""
from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from kvrt.runtime.http.errors import ApiError
from kvrt.runtime.http.text_limits import ids_problem, messages_problem, text_problem
from kvrt.runtime.http.text_pool import TextPool

M = TypeVar("M", bound=BaseModel)
TOO_LONG = "context_length_exceeded"


async def parse_body(raw: bytes, model: type[M], pool: TextPool, who: str, max_model_len: int) -> M:
    """`raw` as a `model`, parsed and checked in `who`'s turn of `pool` (at once when small)."""
    return await pool.run(who, len(raw), parse, raw, model, max_model_len)


def parse(raw: bytes, model: type[M], max_model_len: int) -> M:
    """`raw` as a `model`: ApiError (400) when it is not JSON or asks more text work than the
    model's length allows, RequestValidationError when it does not validate."""
    problem = None
    try:
        data = json.loads(raw)
    except RecursionError:
        problem = "the body is JSON nested deeper than the server parses"
    except ValueError as e:
        problem = f"the body is not JSON: {str(e)[:200]}"
    if problem is not None:
        raise ApiError(400, problem, param="body")
    if isinstance(data, dict):
        bound = _bound(data, max_model_len)
        if bound is not None:
            data = None  # (a raised error's frames would keep the body)
            raise ApiError(400, f"{bound[0]}: {bound[1]}", param=bound[0], code=TOO_LONG)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
    data = None
    raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in errors])


def _bound(data: dict, max_model_len: int) -> tuple[str, str] | None:
    """(the field, why) when the body asks more text work than a model of this length takes."""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        if problem := text_problem(len(prompt), max_model_len):
            return "prompt", problem
    elif isinstance(prompt, list):
        for p in prompt if prompt and isinstance(prompt[0], (str, list)) else [prompt]:
            problem = text_problem(len(p), max_model_len) if isinstance(p, str) else \
                ids_problem(len(p), max_model_len) if isinstance(p, list) else None
            if problem:
                return "prompt", problem
    tokens = data.get("tokens")
    if isinstance(tokens, list) and (problem := ids_problem(len(tokens), max_model_len)):
        return "tokens", problem
    messages = data.get("messages")
    if isinstance(messages, list):
        if problem := messages_problem(len(messages), max_model_len):
            return "messages", problem
        if problem := text_problem(sum(map(_text_chars, messages)), max_model_len):
            return "messages", problem
    return None


def _text_chars(message: Any) -> int:
    """The characters of a message's text (its content, or its text parts), 0 for what is not
    text (validation says what is wrong with it)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0
