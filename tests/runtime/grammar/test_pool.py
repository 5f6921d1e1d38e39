"""The engine's compile processes (runtime/grammar/pool.py), real processes over the tiny
tokenizer's vocabulary: a compile past its time limit is killed (its process gone, a fresh one
in its place) and refused naming the limit; one past its memory limit is refused naming that
limit; clients take turns, so one client's slow compiles never hold back another's; closing
the pool fails what waits and leaves no process behind. The queue's order is also checked
without processes."""
from __future__ import annotations

import os
import time

import pytest

from kvrt.runtime.engine.token_bytes import read_token_bytes
from kvrt.runtime.grammar.limits import Limits
from kvrt.runtime.grammar.messages import Setup
from kvrt.runtime.grammar.pool import CompilePool, _Job, _Queues
from kvrt.runtime.grammar.spec import GrammarError
from tests.tokenizer_kit import make_tokenizer_dir

SLOW = {"kind": "regex", "spec": "(a|b)*a(a|b){18}"}  # its automaton doubles with each step of the repeat
QUICK = {"kind": "regex", "spec": "(yes|no), [0-9]{2}"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture
def setup(tmp_path):
    token_bytes, _ = read_token_bytes(make_tokenizer_dir(tmp_path / "tok"))
    return Setup(pieces=[[t, b] for t, b in token_bytes.items()], memory_bytes=1 << 30), max(token_bytes) + 1


def test_clients_take_turns_the_oldest_turn_first():
    q = _Queues()
    for i, client in enumerate([b"a", b"a", b"a", b"b"]):
        q.put(_Job(i, {}, 0, client))
    assert q.take().client == b"a"
    assert q.take().client == b"b"  # a has one running: b's goes ahead of a's second
    assert q.take() is None  # each has one running
    q.done(b"a")
    q.done(b"b")
    q.put(_Job(9, {}, 0, b"c"))
    assert q.take().client == b"c"  # c never had a turn: ahead of a, which had one
    assert q.take().client == b"a"
    q.done(b"a")
    assert q.take().client == b"a" and not q.waiting


@pytest.mark.e2e
@pytest.mark.alone  # it bounds a compile in time
def test_a_slow_compile_is_killed_at_its_limit_while_another_clients_compiles(setup):
    setup, eos = setup
    pool = CompilePool(setup, Limits(seconds=3.0), workers=2)
    try:
        slow = pool.submit(SLOW, eos, b"attacker")
        slow2 = pool.submit(SLOW, eos, b"attacker")  # the attacker's second waits for its first
        deadline = time.monotonic() + 30
        while len(pool.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        before = set(pool.pids())
        quick = pool.submit(QUICK, eos, b"other")
        assert quick.result(timeout=30).nbytes > 0
        assert not slow.done(), "the other client's compile waited for the attacker's"
        with pytest.raises(GrammarError, match="--grammar-timeout") as e:
            slow.result(timeout=30)
        assert e.value.refused
        assert not slow2.done() or slow2.exception() is not None
        killed = before - set(pool.pids())
        assert killed and not any(_alive(p) for p in killed), "the slow compile's process was not killed"
        with pytest.raises(GrammarError, match="--grammar-timeout"):
            slow2.result(timeout=30)
        assert pool.submit(QUICK, eos, b"attacker").result(timeout=30)  # a fresh process took its place
    finally:
        pids = pool.pids()
        pool.close()
    assert not any(_alive(p) for p in pids)


@pytest.mark.e2e
def test_a_compile_past_its_memory_limit_is_refused_naming_it(setup):
    setup, eos = setup
    setup.memory_bytes = 48 << 20
    pool = CompilePool(setup, Limits(seconds=60.0, memory_bytes=48 << 20), workers=1)
    try:
        with pytest.raises(GrammarError, match="--grammar-memory-mib") as e:
            pool.submit({"kind": "regex", "spec": "(a|b)*a(a|b){20}"}, eos).result(timeout=90)
        assert e.value.refused
        assert pool.submit(QUICK, eos).result(timeout=30)
    finally:
        pool.close()


@pytest.mark.e2e
def test_closing_fails_what_waits_and_ends_the_processes(setup):
    setup, eos = setup
    pool = CompilePool(setup, Limits(seconds=30.0), workers=1)
    running = pool.submit(SLOW, eos, b"a")
    waiting = pool.submit(QUICK, eos, b"a")
    time.sleep(1.0)
    pids = pool.pids()
    pool.close()
    for fut in (running, waiting):
        with pytest.raises(GrammarError):
            fut.result(timeout=10)
    assert not any(_alive(p) for p in pids)
