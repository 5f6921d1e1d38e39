"""Structured output keeps its promise over real-world schemas nobody here wrote: SchemaStore's,
as check-jsonschema vendors them (a dev dependency; the test skips without it). Each whole
document, and each of its definitions as the root (its $refs resolved in its document), is
compiled by compile processes as a node compiles it (each compile limited to 3 s here), over
the tiny byte-level tokenizer; then
walks through the tokens each index allows (random first, then toward the nearest end) spell
answers that `jsonschema` (the oracle, with format checks) must accept. A schema is either
followed or refused naming a keyword or a limit; the counts are printed."""
from __future__ import annotations

import json
import os
import random
from collections import Counter, deque

import pytest

from kvrt.runtime.engine.grammars import Grammars
from kvrt.runtime.engine.token_bytes import read_token_bytes
from kvrt.runtime.grammar.limits import Limits
from kvrt.runtime.grammar.messages import Setup
from kvrt.runtime.grammar.schema import ASSERTIONS
from kvrt.runtime.grammar.spec import GrammarError, guided_problem
from tests.tokenizer_kit import make_tokenizer_dir

jsonschema = pytest.importorskip("jsonschema")
check_jsonschema = pytest.importorskip("check_jsonschema")
pytestmark = pytest.mark.e2e  # compile processes

DEFINITIONS_PER_DOCUMENT = 4  # the first few of each document's definitions, in its order
WALKS = 3
LIMIT_WORDS = ("--grammar-timeout", "--grammar-memory-mib", "automaton states", "index of about")


def corpus() -> list[tuple[str, dict]]:
    """(name, schema): every vendored document, then the first definitions of each as roots."""
    vendor = os.path.join(os.path.dirname(check_jsonschema.__file__), "builtin_schemas", "vendor")
    out, defs = [], []
    for name in sorted(os.listdir(vendor)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(vendor, name), encoding="utf-8") as f:
            doc = json.load(f)
        out.append((name, doc))
        for key in ("definitions", "$defs"):
            for d in list(doc.get(key) or {})[:DEFINITIONS_PER_DOCUMENT]:
                root = {k: v for k, v in doc.items() if k == "$schema"}
                for k, name_ in _reachable(doc, f"#/{key}/{d}"):  # the definitions it uses, and no others
                    root.setdefault(k, {})[name_] = doc[k][name_]
                defs.append((f"{name}#/{key}/{d}", {**root, "$ref": f"#/{key}/{d}"}))
    return out + defs


def _reachable(doc: dict, ref: str) -> list[tuple[str, str]]:
    """The (definitions key, name) pairs `ref` uses, itself included, through local $refs."""
    seen, todo = [], [ref]
    while todo:
        parts = todo.pop().split("/")
        if len(parts) < 3 or parts[1] not in ("definitions", "$defs") or parts[2] not in (doc.get(parts[1]) or {}):
            continue
        if (parts[1], parts[2]) in seen:
            continue
        seen.append((parts[1], parts[2]))
        todo += [r for r in _refs(doc[parts[1]][parts[2]]) if r.startswith("#/")]
    return seen


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if isinstance(node.get("$ref"), str) else []) + [r for v in node.values()
                                                                                  for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def distances(index) -> dict[int, int]:
    """Tokens to the nearest final state from each state (reverse breadth-first search)."""
    back: dict[int, list[int]] = {}
    for state, moves in index.get_transitions().items():
        for nxt in moves.values():
            back.setdefault(nxt, []).append(state)
    dist = {s: 0 for s in index.get_final_states()}
    queue = deque(dist)
    while queue:
        s = queue.popleft()
        for prev in back.get(s, ()):
            if prev not in dist:
                dist[prev] = dist[s] + 1
                queue.append(prev)
    return dist


def walk(index, token_bytes: dict[int, bytes], eos: int, rng: random.Random, free: int = 40) -> bytes:
    """An answer the index allows: `free` random tokens, then the shortest way to an end."""
    dist = distances(index)
    moves = index.get_transitions()
    state, out = index.get_initial_state(), []
    for step in range(5000):
        options = {t: n for t, n in moves.get(state, {}).items() if t != eos and n in dist}
        if index.is_final_state(state) and (step >= free or not options or rng.random() < 0.2):
            return b"".join(out)
        if step < free:
            token = rng.choice(sorted(options))
        else:
            best = min(dist[n] for n in options.values())
            token = rng.choice(sorted(t for t, n in options.items() if dist[n] == best))
        out.append(token_bytes[token])
        state = options[token]
    raise AssertionError("a walk toward the end did not end")


def test_every_answer_validates_or_the_schema_is_refused_by_name(tmp_path):
    token_bytes, _ = read_token_bytes(make_tokenizer_dir(tmp_path / "tok"))
    eos = max(token_bytes) + 1
    grammars = Grammars(Setup(pieces=[[t, b] for t, b in token_bytes.items()]), Limits(seconds=3.0), workers=2)
    schemas = corpus()
    assert len(schemas) >= 100
    counts, refusals, answers = Counter(), Counter(), 0
    futures = []
    for name, s in schemas:
        guided = {"kind": "json_schema", "spec": json.dumps(s)}
        if guided_problem(guided):  # what intake refuses: a spec over its size limit
            counts["refused"] += 1
            refusals["size"] += 1
        else:
            futures.append((name, s, grammars.compile(guided, eos, name.encode())))
    rng = random.Random(0)
    try:
        for name, schema, fut in futures:
            try:
                compiled = fut.result(timeout=600)
            except GrammarError as e:
                message = str(e)
                named = [k for k in ASSERTIONS | {"schema"} if f"{k} at #" in message]
                assert e.refused and (named or any(w in message for w in LIMIT_WORDS)), (name, message)
                counts["refused"] += 1
                refusals[named[0] if named else "limit"] += 1
                continue
            validator = jsonschema.validators.validator_for(schema)(schema,
                                                                    format_checker=jsonschema.validators.validator_for(schema).FORMAT_CHECKER)
            for _ in range(WALKS):
                text = walk(compiled.index, token_bytes, eos, rng).decode("utf-8")
                errors = [e.message for e in validator.iter_errors(json.loads(text))]
                assert not errors, (name, text, errors[:3])
                answers += 1
            counts["followed"] += 1
    finally:
        grammars.close()
    print(f"\n{len(schemas)} SchemaStore schemas: {counts['followed']} followed ({answers} answers, every one "
          f"valid), {counts['refused']} refused by name: {dict(refusals.most_common())}")
    assert counts["followed"] > 0
