"""Guided decoding's grammar side on the tiny byte-level tokenizer: the bytes of each token,
compiled indexes (built in this process, as a compile process builds them), the per-request
state (walks through allowed tokens only ever spell text the regex accepts, and EOS is allowed
exactly in complete states), and the intake's shape checks."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvrt.runtime.client.tokenizer import HFTokenizer
from concurrent.futures import Future

from kvrt.runtime.engine.grammars import guided_problem
from kvrt.runtime.engine.guide import GuideState, mask_words
from kvrt.runtime.engine.token_bytes import read_token_bytes
from kvrt.runtime.grammar.compile import build_index, spec_rx, vocabulary
from kvrt.runtime.grammar.limits import Limits
from kvrt.runtime.grammar.pool import Compiled
from kvrt.runtime.grammar.rx import Budget
from kvrt.runtime.grammar.spec import GrammarError
from tests.tokenizer_kit import make_tokenizer_dir

VOCAB = 320  # the model's vocabulary: larger than the tokenizer's, as checkpoints often are
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


class InProcess:
    """Grammars compiled in this process (the fast lane starts no process): `compile` gives a
    done Future, as the node's pool does once a compile ends."""

    def __init__(self, token_bytes: dict[int, bytes]):
        self.token_bytes = token_bytes

    def compile(self, guided: dict, eos: int, client: bytes = b"") -> Future:
        fut: Future = Future()
        size = max(max(self.token_bytes) + 1, eos + 1)
        try:
            index, _ = build_index(guided, vocabulary(self.token_bytes, eos), size, Limits())
            fut.set_result(Compiled(index, size))
        except GrammarError as e:
            fut.set_exception(e)
        return fut


def regex_of(guided: dict) -> str:
    return spec_rx(guided, Budget(1 << 40)).text


@pytest.fixture(scope="module")
def grammars(tok_dir):
    return InProcess(read_token_bytes(tok_dir)[0])


def test_token_bytes_are_what_the_tokenizer_decodes(tok_dir):
    tok = HFTokenizer.from_dir(tok_dir)
    got, special = read_token_bytes(tok_dir)
    assert special == {tok.backend.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert not special & set(got)
    assert {bytes([b]) for b in range(256)} <= set(got.values())  # the byte-level alphabet: any text
    for tid, b in got.items():
        text = b.decode("utf-8", "replace")
        if "\ufffd" not in text:
            assert tok.decode([tid]) == text, tid
    # a whole text's token bytes join to its UTF-8, across multi-byte characters
    text = "héllo 世界 🙂"
    assert b"".join(got[t] for t in tok.encode(text, add_special_tokens=False)) == text.encode()


def _walk(guide: GuideState, rng: np.random.Generator, eos: int, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        allowed = np.flatnonzero(np.unpackbits(guide.mask.view(np.uint8), bitorder="little")[:VOCAB])
        assert len(allowed) and not guide.problem
        t = int(rng.choice(allowed))
        guide.advance(t)
        assert not guide.problem
        if t == eos:
            assert guide.finished
            break
        out.append(t)
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_walks_through_allowed_tokens_spell_what_the_regex_accepts(tok_dir, grammars, seed):
    got, _ = read_token_bytes(tok_dir)
    eos = HFTokenizer.from_dir(tok_dir).eos_token_ids[0]
    spec = {"kind": "json_schema", "spec": json.dumps(SCHEMA)}
    guide = GuideState(spec, grammars.compile(spec, eos), eos, VOCAB)
    guide._index.result()
    assert guide.ready()
    assert mask_words(VOCAB) == len(guide.mask)
    rng = np.random.default_rng(seed)
    out = _walk(guide, rng, eos, 200)
    text = b"".join(got[t] for t in out).decode("utf-8")
    pattern = regex_of(spec)
    if guide.finished:  # complete: the schema holds
        assert re.fullmatch(pattern, text)
        value = json.loads(text)
        assert set(value) == {"name", "ok"} and len(value["name"]) <= 4 and isinstance(value["ok"], bool)
    eos_bit = lambda g: bool(g.mask[eos // 32] >> (eos % 32) & 1)  # noqa: E731
    fresh = GuideState(spec, grammars.compile(spec, eos), eos, VOCAB)
    fresh.ready()
    assert not eos_bit(fresh)  # nothing written yet: the grammar is not complete


def test_eos_only_in_final_states_and_a_token_outside_fails(tok_dir, grammars):
    tok = HFTokenizer.from_dir(tok_dir)
    eos = tok.eos_token_ids[0]
    spec = {"kind": "regex", "spec": "(hello|world)!"}
    g = GuideState(spec, grammars.compile(spec, eos), eos, VOCAB)
    g.advance(tok.encode("hello", add_special_tokens=False)[0])  # before the index: replayed once it is there
    g._index.result()
    assert g.ready()
    for t in tok.encode("hello", add_special_tokens=False)[1:]:
        assert not (g.mask[eos // 32] >> (eos % 32) & 1)
        g.advance(t)
    g.advance(tok.encode("!", add_special_tokens=False)[0])
    assert np.flatnonzero(np.unpackbits(g.mask.view(np.uint8), bitorder="little")).tolist() == [eos]
    g.advance(eos)
    assert g.finished and not g.problem
    bad = GuideState(spec, grammars.compile(spec, eos), eos, VOCAB)
    bad.ready()
    bad.advance(tok.encode("the", add_special_tokens=False)[0])
    assert "outside" in bad.problem and not bad.ready()
    early = GuideState(spec, grammars.compile(spec, eos), eos, VOCAB)
    early.ready()
    early.advance(eos)
    assert "before" in early.problem


def test_a_grammar_that_cannot_compile_or_in_time_fails_the_request():
    never: Future = Future()
    g = GuideState({"kind": "regex", "spec": "a"}, never, 2, VOCAB, timeout_s=0.0)
    assert not g.ready() and "did not compile within" in g.problem and "regex 'a'" in g.problem
    assert not g.refused  # a node too busy to compile in time is the node's failure, not the request's
    # a vocabulary that cannot spell the regex: the compile fails, naming the spec
    small = InProcess({0: b"a", 1: b"b"})
    spec = {"kind": "regex", "spec": "[0-9]+"}
    g = GuideState(spec, small.compile(spec, 2), 2, VOCAB)
    with pytest.raises(ValueError):
        g._index.result()
    assert not g.ready() and "cannot compile guided regex '[0-9]+'" in g.problem and g.refused


def test_a_tokenizer_with_more_ids_than_the_model_is_cut_to_the_model():
    """Token ids past the model's vocabulary are never allowed, and a state that allows only
    such tokens is dead."""
    big = InProcess({0: b"a", 1: b"b", 40: b"c", 70: b"d"})
    for regex, want in (("[abc]", [0, 1]), ("d", [])):
        spec = {"kind": "regex", "spec": regex}
        g = GuideState(spec, big.compile(spec, 2), 2, 40)  # a model of 40 tokens: "c" (40) is past it
        g._index.result()
        assert g.ready() == bool(want)
        got = np.flatnonzero(np.unpackbits(g.mask.view(np.uint8), bitorder="little")).tolist()
        assert got == want and (("allows no token" in g.problem) == (not want))


@pytest.mark.parametrize("guided, words", [
    ({"kind": "xml"}, "kind must be one of"),
    ({"kind": "regex", "spec": 5}, "must be a string"),
    ({"kind": "regex", "spec": ""}, "empty"),
    ({"kind": "json_schema", "spec": "x" * 70000}, "longer than"),
    ("json", "guided must be"),
    ({"kind": "regex", "spec": "a", "x": 1}, "guided must be"),
])
def test_bad_shapes_are_named_at_intake(guided, words):
    assert words in guided_problem(guided)


@pytest.mark.parametrize("guided, words", [
    ({"kind": "regex", "spec": "a("}, "not a regex"),
    ({"kind": "regex", "spec": "(a)\\1"}, "back-references"),
    ({"kind": "json_schema", "spec": "{"}, "not JSON"),
    ({"kind": "json_schema", "spec": '{"type": "nope"}'}, "unknown type"),
    ({"kind": "json_schema", "spec": '{"type": "string", "format": "ipv6"}'}, "format"),
    ({"kind": "choice", "spec": "[]"}, "non-empty strings"),
    ({"kind": "grammar", "spec": 'root ::= "(" root ")" | "x"'}, "recursive"),
])
def test_what_a_spec_says_is_refused_by_the_compile_naming_it(guided, words):
    """The front doors check only the shape; what a spec says is refused where it is compiled."""
    assert guided_problem(guided) == ""
    with pytest.raises(GrammarError, match=words) as e:
        build_index(guided, vocabulary({0: b"a", 1: b"b"}, 2), 3, Limits())
    assert e.value.refused


def test_good_specs_pass_and_json_mode_is_an_object():
    assert guided_problem(None) == ""
    assert guided_problem({"kind": "json_object", "spec": ""}) == ""
    assert guided_problem({"kind": "json_schema", "spec": json.dumps(SCHEMA)}) == ""
    json_object = regex_of({"kind": "json_object", "spec": ""})
    assert re.fullmatch(json_object, '{"a": {"b": 1, "c": "x"}, "d": [true, null, 2]}')
    assert not re.fullmatch(json_object, '[1]')
