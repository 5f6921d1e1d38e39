"""Structured output end to end: the official `openai` client against a launched node serving a
random-weight tiny checkpoint with its tokenizer. Random weights want to write anything, so an
answer that parses and fits its schema on every seed is the grammar's doing alone: JSON mode
and a json_schema (chat, streamed and not), a regex (completions, vLLM's guided_regex), a cut
by max_tokens ("length"), and bad specs answered 400 naming response_format."""
from __future__ import annotations

import json
import re

import openai
import pytest

from kvrt.ipc.ports import free_port
from tests.hfkit import make_checkpoint
from tests.launched import launched
from tests.runtime.http.test_http import _client, _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": -999, "maximum": 999}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["name", "ok", "n", "kind"]}
SEEDS = 16


def fits(value: object) -> bool:
    """SCHEMA, checked by hand."""
    return (isinstance(value, dict) and set(value) == {"name", "ok", "n", "kind"}
            and isinstance(value["name"], str) and len(value["name"]) <= 6 and isinstance(value["ok"], bool)
            and isinstance(value["n"], int) and not isinstance(value["n"], bool) and abs(value["n"]) < 1000 and value["kind"] in ("cat", "dog"))


@pytest.fixture
def served(node, tmp_path):
    directory = tmp_path / "qwen2"
    make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=7, vocab_size=320)
    make_tokenizer_dir(directory)
    http = free_port()
    # compiles limited to 10 s, not 20: the corpus sample's one schema that compiles in neither is
    # refused 10 s sooner; the slowest one followed compiles in 3 to 6 s on a loaded 2-core machine
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "256",
                  "--http-port", str(http), "--grammar-timeout", "10"):
        _wait_healthy(http)
        yield _client(http), str(directory)


@pytest.mark.e2e
def test_json_schema_json_mode_and_regex_always_hold_and_bad_specs_are_400(served):
    c, model = served
    msgs = [{"role": "user", "content": "hello world"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for seed in range(SEEDS):
        r = c.chat.completions.create(model=model, messages=msgs, response_format=fmt, temperature=1.0, seed=seed,
                                      max_tokens=96)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice)
        assert fits(json.loads(choice.message.content)), (seed, choice.message.content)
    # streamed: the pieces join into the same kind of answer
    pieces, reasons = [], []
    for chunk in c.chat.completions.create(model=model, messages=msgs, response_format=fmt, temperature=1.0, seed=99,
                                           max_tokens=96, stream=True):
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
    assert reasons[-1] == "stop" and fits(json.loads("".join(pieces)))
    # JSON mode: every answer the grammar completed is a JSON object; one cut short is "length"
    done = 0
    for seed in range(SEEDS):
        r = c.chat.completions.create(model=model, messages=msgs, response_format={"type": "json_object"},
                                      temperature=1.0, seed=seed, max_tokens=128)
        choice = r.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict), choice.message.content
            done += 1
        else:
            assert choice.message.content.startswith("{")
    assert done >= SEEDS // 4
    # vLLM's guided_regex on completions, greedy and sampled
    for seed in range(4):
        r = c.completions.create(model=model, prompt="the quick", max_tokens=16, temperature=seed / 2, seed=seed,
                                 extra_body={"guided_regex": "(yes|no), [0-9]{2}"})
        assert r.choices[0].finish_reason == "stop" and re.fullmatch("(yes|no), [0-9]{2}", r.choices[0].text)
    # max_tokens before the grammar is complete: "length", not an error
    r = c.chat.completions.create(model=model, messages=msgs, response_format=fmt, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    _bad_specs_are_400_naming_the_field(c, model)
    _vllm_fields_choice_grammar_and_structured_outputs(c, model)
    _corpus_answers_validate(c, model)


def _vllm_fields_choice_grammar_and_structured_outputs(c: openai.OpenAI, model: str) -> None:
    """vLLM's guided_choice, guided_grammar (GBNF and Lark) and structured_outputs, each held."""
    gbnf = 'root ::= "SELECT " col " FROM " table\ncol ::= "a" | "b"\ntable ::= "t" [0-9]'
    lark = 'start: "SELECT " COL " FROM t"\nCOL: "a" | "b"'
    cases = [({"guided_choice": ["yes", "no", "maybe"]}, "yes|no|maybe"),
             ({"guided_grammar": gbnf}, "SELECT (a|b) FROM t[0-9]"),
             ({"guided_grammar": lark}, "SELECT (a|b) FROM t"),
             ({"structured_outputs": {"choice": ["up", "down"]}}, "up|down"),
             ({"structured_outputs": {"regex": "[0-9]{3}"}}, "[0-9]{3}"),
             ({"structured_outputs": {"json": {"type": "integer", "minimum": 3, "maximum": 9}}}, "[3-9]")]
    for extra, want in cases:
        for seed in range(3):
            r = c.completions.create(model=model, prompt="the quick", max_tokens=24, temperature=1.0, seed=seed,
                                     extra_body=extra)
            assert r.choices[0].finish_reason == "stop" and re.fullmatch(want, r.choices[0].text), (extra, r)
    for extra, param in (({"guided_grammar": 'root ::= "(" root ")" | "x"'}, "guided_grammar"),
                         ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
                         ({"guided_json": {"type": "integer", "multipleOf": 7}}, "guided_json")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=model, prompt="hi", max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body


def _corpus_answers_validate(c: openai.OpenAI, model: str) -> None:
    """The model's own answers to real-world schemas (SchemaStore's, from check-jsonschema)
    validate under jsonschema, or the request is refused naming what it cannot enforce; an
    answer cut by max_tokens is counted apart. The counts are printed."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema")
    from tests.runtime.grammar.test_schema_corpus import corpus

    counts = {"valid": 0, "refused": 0, "length": 0}
    for name, schema in corpus()[26::6]:  # a sample of the definitions, as roots
        try:
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], temperature=0.7,
                                          seed=1, max_tokens=160, response_format={
                                              "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        except openai.BadRequestError as e:
            assert e.body["param"] == "response_format", e.body
            assert " at #" in e.message or "limit" in e.message or "longer than" in e.message, (name, e.message)
            counts["refused"] += 1
            continue
        choice = r.choices[0]
        if choice.finish_reason == "length":
            counts["length"] += 1
            continue
        validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.validators.validator_for(schema).FORMAT_CHECKER)
        errors = [e.message for e in validator.iter_errors(json.loads(choice.message.content))]
        assert not errors, (name, choice.message.content, errors[:3])
        counts["valid"] += 1
    print(f"\nthe model's answers to SchemaStore schemas: {counts}")


def _bad_specs_are_400_naming_the_field(c: openai.OpenAI, model: str) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format"),
           ({"response_format": {"type": "yaml"}}, "response_format"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
           ({"extra_body": {"guided_regex": "a("}}, "guided_regex")]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=msgs, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body
    # a text response_format asks for nothing
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")
