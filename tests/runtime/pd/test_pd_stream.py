"""The P->D handoff streamed with the prefill, with real nodes: P orders each prefill chunk's
full blocks to its cache-messagers as soon as the chunk's step wrote them, so most of a long
prompt's KV is in D before the prefill ends. Answers must still equal the dense reference, no
block may be written while a cache-messager reads it (KVRT_CHECK_OWNERSHIP=1), and a request
cancelled mid-prefill, with sends in flight, must leave no block in use on either side.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence, SeqState
from kvrt.runtime.pd.connector import SchedulerHooks
from tests.launched import oracle
from tests.runtime.engine.test_oracle import NEW, run_all, tokens
from tests.runtime.pd.test_pd import TRANSPORTS, pd_node, pd_pair, wait_for  # noqa: F401 (pd_node: a fixture)

# chunks of 16 tokens over blocks of 8: a prompt of N tokens takes N/16 steps
CHUNKED = ("--max-num-batched-tokens", "16", "--num-gpu-blocks", "256")


def long_prompts(seed: int, n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, int(rng.integers(90, 160))).astype(np.int32) for _ in range(n)]


@pytest.mark.e2e
@pytest.mark.parametrize("env", [pytest.param({}, id="plain"),
                                 pytest.param({"KVRT_CHECK_OWNERSHIP": "1"}, id="ownership")])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blocks_travel_while_the_prefill_runs(pd_node, tmp_path, transport, env):
    prompts = long_prompts(seed=3)
    model = oracle()
    want = [model.generate_dense(p, NEW) for p in prompts]
    with pd_pair(pd_node, tmp_path, *CHUNKED, transport=transport, env=env) as (p, d):
        assert tokens(run_all(p.client, prompts)) == want, p.logs() + d.logs()
        assert tokens(run_all(p.client, prompts[:1], concurrent=False)) == want[:1]
        pe, de = p.idle_stats(), d.idle_stats()
        assert pe["pd_early_blocks"] > 0, "no block was sent before its prefill's last chunk"
        assert 0 < pe["pd_early_bytes"] < pe["pd_sent_bytes"]
        assert pe["device_used"] == 0 and de["device_used"] == 0
        assert pe["failed_requests"] == de["failed_requests"] == 0


@pytest.mark.e2e
def test_cancel_mid_prefill_frees_both_sides(pd_node, tmp_path):
    """4 tokens a step over 2,000 tokens: the cancel lands mid-prefill with blocks already
    sent; the lease is long, so D's blocks come back through P's abort, not its expiry."""
    prompt = np.random.default_rng(4).integers(0, 512, 2000).astype(np.int32)
    opts = ("--max-num-batched-tokens", "4", "--max-model-len", "8192", "--num-gpu-blocks", "1024",
            "--pd-timeout", "120")
    with pd_pair(pd_node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as (p, d):
        rid = p.client.submit(prompt, 8)
        wait_for(lambda: p.engine_stats()["pd_early_blocks"] >= 8, "P to send blocks while prefilling", 60)
        p.client.cancel(rid)
        events = []
        while not [e for e in events if getattr(e, "request_id", "") == rid and hasattr(e, "finish_reason")]:
            got = p.client.poll(timeout=30)
            assert got, "no answer to the cancel within 30 s"
            assert not [e for e in got if hasattr(e, "code")], got
            events += got
        done = [e for e in events if hasattr(e, "finish_reason")][0]
        assert done.finish_reason == "cancelled"
        wait_for(lambda: d.engine_stats()["device_used"] == 0, "D to free the request's blocks", 20)
        pe, de = p.idle_stats(), d.idle_stats()
        assert pe["device_used"] == 0 and de["device_used"] == 0
        assert de["finished_requests"] == 0 and pe["failed_requests"] == 0
        # both still serve, and the cancelled prompt's blocks P cached are reused correctly
        assert p.client.generate(prompt[:40], NEW).output_token_ids.tolist() == oracle().generate_dense(prompt[:40], NEW)


class _Reading(SchedulerHooks):
    """A connector whose ranks read the blocks of the requests in `busy` (a unit-test fake)."""

    def __init__(self) -> None:
        self.busy: set[str] = set()

    def reading(self, seq: Sequence) -> bool:
        return seq.request_id in self.busy


def _seq(rid: str, n: int, new: int, seed: int) -> Sequence:
    prompt = np.random.default_rng(seed).integers(0, 100, n).astype(np.int32)
    return Sequence.new(rid, prompt, new, 4)


def test_blocks_being_read_outlive_their_request_and_its_preemption():
    """The scheduler never preempts a request whose blocks a connector reads (here: an older
    decoding request grows into a pool too small for both, and the reading one is the newest,
    so the victim), and one that ends meanwhile keeps its blocks until they are released."""
    cache, hooks = PrefixCache(4, 8), _Reading()
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=12, connector=hooks)
    b, a = _seq("b", 4, 24, 1), _seq("a", 20, 8, 2)
    s.add(b)
    s.add(a)
    hooks.busy.add("a")
    for _ in range(8):
        if (step := s.schedule()) is not None:
            s.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))
    assert a.preemptions == 0 and a.state is SeqState.RUNNING, "a request whose blocks are being sent was preempted"
    table = cache.block_table("a")
    assert s.cancel("a") is a and a.state is SeqState.FINISHED
    assert cache.block_table("a") == table, "blocks being sent were released"
    with pytest.raises(ValueError):
        s.add(_seq("a", 8, 1, 3))  # its id stays taken while its blocks are held
    hooks.busy.clear()
    s.release_held(a)
    assert not s.held and cache.block_usage()["device_used"] < 8
    drain = 0
    while not s.idle and drain < 100:  # b finishes once a's blocks are back
        if (step := s.schedule()) is not None:
            s.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))
        drain += 1
    assert b.finish_reason == "length"
    cache.check()
