"""The P->D handoff streamed with the prefill, with real nodes: P orders each prefill chunk's
full blocks to its cache-messagers as soon as the chunk's step wrote them, so most of a long
prompt's KV is in D before the prefill ends. Answers must still equal the dense reference, no
block may be written while a cache-messager reads it (KVRT_CHECK_OWNERSHIP=1), and a request
cancelled mid-prefill, with sends in flight, must leave no block in use on either side.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.launched import oracle
from tests.test_oracle import NEW, run_all, tokens
from tests.test_pd import TRANSPORTS, pd_node, pd_pair, wait_for  # noqa: F401 (pd_node: a fixture)

# chunks of 16 tokens over blocks of 8: a prompt of N tokens takes N/16 steps
CHUNKED = ("--max-num-batched-tokens", "16", "--num-gpu-blocks", "256")


def long_prompts(seed: int, n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, int(rng.integers(90, 160))).astype(np.int32) for _ in range(n)]


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
