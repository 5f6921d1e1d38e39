"""The KV connector seam with a fake connector: the scheduler calls the hooks at the moments
their docs promise and knows nothing else of what is on the other side; the engine picks its
connector from one factory and has no role branch; a rank group collects one answer per rank
before a deadline."""
from __future__ import annotations

import ast
import pathlib
import re
import time

import numpy as np
import pytest

from kvrt.ipc import protocol as P
from kvrt.ipc.rank_group import RankGroup
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.client import api
from kvrt.runtime.engine import engine as engine_mod
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence, SeqState
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.pd.connector import KVConnector
from kvrt.runtime.pd.connector import SchedulerHooks
from kvrt.runtime.pd.decode import DecodeConnector
from kvrt.runtime.pd.prefill import PrefillConnector
from kvrt.runtime.pd.roles import connector_class
from tests.conftest import REPO
from tests.nodekit import engine_with_worker

BS = 4
ROOT = pathlib.Path(REPO)


class FakeConnector(SchedulerHooks):
    """Supplies `external` prompt tokens of requests named in `from_outside` (asynchronously
    unless `sync`), takes over the requests named in `take_over` after their first token, and
    records every hook call."""

    def __init__(self, from_outside=(), take_over=(), sync: bool = False):
        self.from_outside, self.take_over, self.sync = set(from_outside), set(take_over), sync
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, seq):
        self.calls.append(("matched?", seq.request_id))
        return (seq.prompt_len, not self.sync) if seq.request_id in self.from_outside else (0, False)

    def update_state_after_alloc(self, seq, blocks):
        self.calls.append(("allocated", seq.request_id, list(blocks)))

    def takes_over(self, seq):
        self.calls.append(("take over?", seq.request_id, seq.num_output))
        return seq.request_id in self.take_over


def seq(rid: str, n: int, new: int = 3, seed: int = 0) -> Sequence:
    prompt = np.random.default_rng(seed).integers(0, 100, n).astype(np.int32)
    return Sequence.new(rid, prompt, new, BS)


def run(s: Scheduler, limit: int = 100) -> None:
    for _ in range(limit):
        step = s.schedule()
        if step is None:
            return
        s.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))


def test_external_kv_is_held_for_told_about_and_resumed():
    cache = PrefixCache(BS, 32)
    fake = FakeConnector(from_outside={"x"})
    s = Scheduler(cache, 4, 64, connector=fake)
    x, local = seq("x", 18), seq("local", 10, seed=1)
    s.add(x)
    s.add(local)
    assert fake.calls == [("matched?", "x"), ("matched?", "local")]
    assert [q.request_id for q in s.admit_external()] == ["x"] and x.state is SeqState.EXTERNAL
    table = cache.block_table("x")
    assert fake.calls[-1] == ("allocated", "x", table[:5]), "blocks for the whole prompt, once"
    assert s.incoming_blocks() == table[:5], "nobody here may touch blocks being written from outside"
    step = s.schedule()
    assert step.seqs == [local], "a request waiting for external KV is never scheduled"
    s.finish_step(step, np.array([7], dtype=np.int32))
    assert s.cancel("x") is None and x.state is SeqState.EXTERNAL, "its blocks are in a transfer"
    x.cancelled = False
    assert s.external_kv_arrived(x, 9) and x.state is SeqState.RUNNING and x.output.tolist() == [9]
    assert s.incoming_blocks() == [] and cache.lookup(x.keys) == 4
    run(s)
    assert s.idle and cache.block_usage()["device_used"] == 0
    cache.check()


def test_a_synchronous_external_load_is_computed_here():
    cache = PrefixCache(BS, 32)
    s = Scheduler(cache, 4, 64, connector=FakeConnector(from_outside={"x"}, sync=True))
    x = seq("x", 10)
    s.add(x)
    assert s.admit_external() == [] and list(s.waiting) == [x]
    run(s)
    assert x.finish_reason == "length"


def test_a_request_taken_over_keeps_its_blocks_until_dropped():
    cache = PrefixCache(BS, 32)
    fake = FakeConnector(take_over={"p"})
    s = Scheduler(cache, 4, 8, connector=fake)
    p, q = seq("p", 10, new=5), seq("q", 6, seed=1)
    s.add(p)
    s.add(q)
    run(s)
    assert ("take over?", "p", 0) not in fake.calls, "asked only once a token was sampled"
    assert ("take over?", "p", 1) in fake.calls
    assert p.state is SeqState.EXTERNAL and p not in s.running and p.output.tolist() == [7]
    assert q.finish_reason == "length", "the others run on"
    assert len(cache.block_table("p")) == 3, "its blocks stay held for the transfer"
    assert s.cancel("p") is None, "cancel only marks it: the connector ends it"
    s.drop(p, "handoff")
    assert s.idle and cache.block_usage()["device_used"] == 0
    cache.check()


def test_without_a_connector_nothing_is_external():
    cache = PrefixCache(BS, 32)
    s = Scheduler(cache, 4, 64)
    a = seq("a", 9)
    s.add(a)
    assert s.admit_external() == []
    run(s)
    assert a.finish_reason == "length" and s.incoming_blocks() == []


def test_one_factory_picks_the_connector_from_the_role():
    assert connector_class("mixed") is KVConnector and not KVConnector.has_ranks
    assert connector_class("prefill") is PrefillConnector and connector_class("decode") is DecodeConnector
    assert PrefillConnector.has_ranks and DecodeConnector.has_ranks
    with pytest.raises(ValueError, match="no KV connector for role 'storage'"):
        connector_class("storage")
    for role in ("mixed", "prefill", "decode"):  # the engine attaches the rings the launcher made
        assert connector_class(role).has_ranks == NodeConfig("n", role=role).disaggregated, role


def test_the_engine_never_branches_on_the_role():
    tree = ast.parse((ROOT / "runtime" / "engine" / "engine.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            assert not re.search(r"\brole\b|prefill|decode", text), text
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.BoolOp)):
            test = node if isinstance(node, ast.BoolOp) else node.test
            assert not re.search(r"\brole\b|\.prefill\b|\.decode\b", ast.unparse(test)), ast.unparse(test)


def test_a_rank_group_collects_one_answer_per_rank_before_its_deadline():
    g: RankGroup[str] = RankGroup(3, deadline=100.0)
    assert not g.add(2, "c") and not g.add(0, "a") and g.missing() == [1]
    assert not g.expired(now=99.0) and g.expired(now=100.0)
    assert g.add(1, "b") and g.answers == ["a", "b", "c"] and not g.expired(now=1e9)
    with pytest.raises(ValueError):
        g.add(3, "d")
    with pytest.raises(ValueError):
        RankGroup(0, 1.0)


class HandOffEverything(KVConnector):
    """A fake connector for a real engine: every request of more than one token is taken over
    after its first token, 'sent' when the engine asks for this step's orders, then dropped."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls: list[tuple] = []
        self._due: list[Sequence] = []

    def on_request(self, client, req):
        self.calls.append(("request", req.request_id))
        return False

    def takes_over(self, seq):
        self.calls.append(("takes over", seq.request_id, seq.num_output))
        if seq.max_new_tokens > 1:
            self._due.append(seq)
            return True
        return False

    def build_orders(self):
        due, self._due = self._due, []
        for seq in due:
            self.calls.append(("sent", seq.request_id, len(self.ctx.block_table(seq.request_id))))
            self.ctx.sched.drop(seq, "handoff")
            self.ctx.finished(seq)

    def request_finished(self, seq):
        self.calls.append(("finished", seq.request_id, seq.finish_reason))


@pytest.mark.e2e
def test_a_real_engine_calls_the_hooks_of_its_connector(node, monkeypatch):
    """A node with a real worker process; the engine gets a fake connector from its one factory
    and calls its hooks at the promised moments, never anything role-specific."""
    monkeypatch.setattr(engine_mod, "connector_class", lambda role: HandOffEverything)
    cfg = NodeConfig(node, tp=1, block_size=BS, num_gpu_blocks=16, num_cpu_blocks=0, rank_timeout=20,
                     num_layers=2, num_kv_heads=2, head_dim=8).validate()
    with engine_with_worker(cfg) as eng:
        fake = eng.connector
        assert isinstance(fake, HandOffEverything) and eng.sched.connector is fake
        deadline = time.monotonic() + 60
        prompt = np.arange(1, 11, dtype=np.int32)
        eng.api.on_generate(b"client", api.GenerateRequest("long", prompt, 5))
        eng.api.on_generate(b"client", api.GenerateRequest("short", prompt + 1, 1))
        while not eng.sched.idle:
            assert time.monotonic() < deadline, "the requests did not end"
            eng.step()
        assert fake.calls[:2] == [("request", "long"), ("request", "short")]
        assert ("takes over", "long", 0) not in fake.calls, "asked only once a token was sampled"
        assert fake.calls.index(("takes over", "long", 1)) < fake.calls.index(("sent", "long", 3))
        assert ("finished", "long", "handoff") in fake.calls and ("finished", "short", "length") in fake.calls
        assert eng.cache.block_usage()["device_used"] == 0
        assert eng.stats.array[P.STAT["finished_requests"]] == 2
        eng.cache.check()
