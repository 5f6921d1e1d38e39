"""A JSON schema as a grammar (runtime/grammar/schema.py): for schemas that use each enforced
keyword, every document the regex spells validates under jsonschema (the oracle, format checks
on); each keyword kvrt cannot enforce is refused naming it; size bombs are refused before any
text is built; vLLM's other kinds (choice, EBNF grammars) follow their spec or are refused by name."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from kvrt.runtime.grammar.compile import spec_rx
from kvrt.runtime.grammar.ebnf import GrammarRefused, grammar_rx
from kvrt.runtime.grammar.rx import Budget, TooBig
from kvrt.runtime.grammar.schema import Refused, schema_regex
from kvrt.runtime.grammar.spec import GrammarError

jsonschema = pytest.importorskip("jsonschema")
BIG = Budget(1 << 40)


def narrow(text: str) -> str:
    """The same regex over fewer characters (classes cut at U+017F): what it spells is still
    what the grammar spells, and hypothesis draws from Unicode-wide classes very slowly."""
    text = re.sub(r"\\u(?:e000|202a)-\\[uU][0-9a-f]+", "", text)
    return re.sub(r"-\\u(?:d7ff|2027)", r"-\\u017f", text)
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 150},
        "born": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"},
        "zip": {"type": "string", "pattern": r"^\d{5}$"}, "score": {"type": "number", "exclusiveMinimum": -1.5,
                                                                     "exclusiveMaximum": 2}},
        "required": ["name", "age"], "additionalProperties": False},
    "refs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
             "type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 3},
    "one_of": {"oneOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "integer", "minimum": 10},
                         {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]}]},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                         {"properties": {"b": {"type": "null"}}, "required": ["b"]}]},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}],
              "items": False, "minItems": 1},
    "map": {"type": "object", "additionalProperties": {"type": "integer", "maximum": -5}, "maxProperties": 3},
    "deps": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                              "c": {"type": "integer"}},
             "dependentRequired": {"a": ["b"]}, "minProperties": 2, "maxProperties": 2},
    "unique": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "recursive": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}, "required": ["v"]}}, "$ref": "#/$defs/node"},
    "draft4": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0,
               "exclusiveMinimum": True, "maximum": 5},
    "enum_with_type": {"type": "string", "enum": ["x", 1, "yy", None], "maxLength": 1},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_every_document_the_grammar_spells_validates(name, data):
    schema = SCHEMAS[name]
    rx = schema_regex(schema, BIG)
    text = data.draw(st.from_regex(re.compile(narrow(rx.text)), fullmatch=True))
    value = json.loads(text)
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.validators.validator_for(schema).FORMAT_CHECKER)
    assert not list(validator.iter_errors(value)), (name, text)


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "string", "format": "ipv6"}, "format"),
    ({"type": "string", "pattern": "(?<=a)b"}, "pattern"),
    ({"type": "string", "pattern": "^[a-z]+-[0-9]+$", "maxLength": 4}, "maxLength"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf"),
    ({"$ref": "https://example.com/x.json"}, "$ref"),
    ({"type": "object", "properties": {"x-a": {}}, "patternProperties": {"^x-": {"type": "integer"}}},
     "patternProperties"),
    ({"type": "array", "uniqueItems": True, "minItems": 2}, "uniqueItems"),
    ({"type": "number", "minimum": 0.1, "maximum": 0.5}, "minimum"),
    ({"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]}, "allOf"),
    ({"type": "string", "minLength": 10 ** 9}, "minLength"),
    ({"type": "array", "items": {"type": "string"}, "minItems": 10 ** 9}, "minItems"),
])
def test_a_keyword_kvrt_cannot_enforce_is_refused_naming_it(schema, keyword):
    with pytest.raises(Refused) as e:
        schema_regex(schema, Budget(100_000))
    assert e.value.keyword == keyword, str(e.value)
    assert str(e.value).startswith(f"{keyword} at #")


def test_a_size_bomb_is_refused_before_its_text_is_built():
    with pytest.raises((TooBig, Refused), match="automaton states"):
        schema_regex({"type": "array", "items": {"type": "array", "items": {"type": "string", "maxLength": 900},
                                                 "maxItems": 900}, "maxItems": 900}, Budget(100_000))
    with pytest.raises(GrammarError, match="automaton states"):
        spec_rx({"kind": "regex", "spec": "(x{1000}){1000}"}, Budget(100_000))


def test_choice_and_grammars():
    rx = spec_rx({"kind": "choice", "spec": json.dumps(["a.b", "c|d"])}, BIG)
    assert re.fullmatch(rx.text, "a.b") and re.fullmatch(rx.text, "c|d") and not re.fullmatch(rx.text, "axb")
    gbnf = 'root ::= greet " " name{1,2} # a comment\ngreet ::= "hi" | "hello"\nname ::= [A-Z] [a-z]*'
    rx = grammar_rx(gbnf, BIG)
    assert re.fullmatch(rx.text, "hi Bob") and re.fullmatch(rx.text, "hello AnnBo") and not re.fullmatch(rx.text, "hi")
    lark = 'start: "x=" NUM ["!"]\nNUM: /[0-9]+/ // digits\n'
    rx = grammar_rx(lark, BIG)
    assert re.fullmatch(rx.text, "x=12!") and re.fullmatch(rx.text, "x=3") and not re.fullmatch(rx.text, "x=")
    for text, words in (('root ::= "(" root ")" | "x"', "recursive"), ("start: a\na: b\nb: a", "recursive"),
                        ('%import common.WS\nstart: "a"', "%import"), ('start: "a"i', "case-insensitive"),
                        ('root ::= missing', "not defined"), ('rule ::= "a"', "no 'root'")):
        with pytest.raises(GrammarRefused, match=words):
            grammar_rx(text, BIG)


KEYS = st.sampled_from(["type", "properties", "required", "items", "prefixItems", "enum", "const", "anyOf", "oneOf",
                        "allOf", "$ref", "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength",
                        "pattern", "format", "minItems", "maxItems", "minProperties", "maxProperties",
                        "additionalProperties", "dependentRequired", "uniqueItems", "multipleOf", "a", "x"])
JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-5, 5, allow_nan=False)
                    | st.sampled_from(["string", "integer", "object", "array", "#", "#/x", "[a-z]+", "date", "a"]),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(schema=JSON)
def test_any_json_as_a_schema_is_a_regex_or_a_named_refusal(schema):
    """Whatever a client sends as a schema, the compile answers with a regex or a GrammarError
    (never another exception: in a compile process that would be the process's end)."""
    try:
        spec_rx({"kind": "json_schema", "spec": json.dumps(schema)}, Budget(20_000))
    except GrammarError:
        pass
