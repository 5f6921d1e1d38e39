"""Exact-output oracle for a model whose layers form groups: real nodes serving the reference
model with a full-attention layer and a sliding one (`--layer-windows 0,12`: a page per group in
the one pool, sliding pages given back as their window leaves them, runtime/cache/groups.py)
give the dense reference's greedy tokens, with the prefix cache on and off, a pool small
enough to evict and preempt, host swaps of either group's pages, FP8 blocks, and every order
checked against the block owners (KVRT_CHECK_OWNERSHIP=1)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvrt.ipc.layout import FP8_E4M3
from kvrt.workers.model.transformer import Model
from tests.launched import SMALL, launched, oracle, shared_prefix_prompts
from tests.runtime.engine.test_oracle import run_all, tokens

pytestmark = pytest.mark.e2e

NEW = 6
WINDOWS = ("--layer-windows", "0,12")


def grouped_oracle(kv: str = "float32") -> Model:
    m = oracle()
    return Model(dataclasses.replace(m.shape, layer_windows=(0, 12)), kv_dtype=kv)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=21)


@pytest.fixture(scope="module")
def expected(prompts):
    model = grouped_oracle()
    want = [model.generate_dense(p, NEW) for p in prompts]
    assert want != [oracle().generate_dense(p, NEW) for p in prompts], "the window must change some answer"
    return want


def test_cache_on_off_and_dense_agree(node, tmp_path, prompts, expected):
    with launched(node, tmp_path, *SMALL, *WINDOWS, "--num-gpu-blocks", "512",
                  env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        seq = run_all(ln.client, prompts, concurrent=False)
        assert tokens(seq) == expected, ln.logs()
        assert sum(r.cached_device for r in seq) > 0, "shared prefixes must hit the device tier"
        assert tokens(run_all(ln.client, prompts, use_cache=False)) == expected
        again = run_all(ln.client, prompts)
        assert tokens(again) == expected
        assert all(r.cached_device > 0 for r in again), "each prompt's own window was cached last time"
        stats = ln.idle_stats()
        assert stats["device_used"] == 0, "finished requests must hold no pages"


@pytest.mark.parametrize("host_blocks", [0, 96], ids=["evict", "swap"])
def test_tiny_pool_swaps_evicts_preempts(node, tmp_path, prompts, expected, host_blocks):
    opts = (*SMALL, *WINDOWS, "--num-gpu-blocks", "80", "--num-cpu-blocks", str(host_blocks),
            "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        first = run_all(ln.client, prompts)
        assert tokens(first) == expected, ln.logs()
        second = run_all(ln.client, prompts, concurrent=False)
        assert tokens(second) == expected, ln.logs()
        stats = ln.idle_stats()
        assert stats["device_used"] == 0 and stats["host_used"] == 0
        assert stats["evictions"] > 0
        if host_blocks:
            assert stats["tasks_failed"] == 0
            assert sum(r.cached_host for r in first + second) > 0, "some prefix must come back from the host"


def test_fp8_pages_evicted_and_swapped(node, tmp_path, prompts):
    """FP8 pages of both groups, evicted to the host tier and swapped back: the bytes move as
    they are."""
    model = grouped_oracle(FP8_E4M3)
    want = [model.generate_dense(p, NEW) for p in prompts]
    with launched(node, tmp_path, *SMALL, *WINDOWS, "--kv-cache-dtype", "fp8", "--num-gpu-blocks", "80",
                  "--num-cpu-blocks", "96", "--max-num-batched-tokens", "64") as ln:
        first = run_all(ln.client, prompts)
        assert tokens(first) == want, ln.logs()
        second = run_all(ln.client, prompts, concurrent=False)
        assert tokens(second) == want, ln.logs()
        assert sum(r.cached_host for r in first + second) > 0, "some prefix must come back from the host"


def test_long_decode_holds_only_its_window_of_sliding_pages(node, tmp_path):
    """A 40-token prompt decoding 200 tokens over 8-token blocks: 30 blocks of full pages, and
    never more than the window's and a 16-token chunk's sliding pages (6): a pool of 40 pages
    holds it alone, where one page per block and group would take 60."""
    prompt = np.arange(40, dtype=np.int32) * 7 % 512
    want = grouped_oracle().generate_dense(prompt, 200)
    with launched(node, tmp_path, *SMALL, *WINDOWS, "--num-gpu-blocks", "40", "--max-num-batched-tokens", "16") as ln:
        got = ln.client.generate(prompt, 200)
        assert got.output_token_ids.tolist() == want
        assert ln.idle_stats()["preemptions"] == 0


@pytest.fixture
def pd_node(node):
    from tests.runtime.pd.test_pd import pd_node as fixture  # (both of its nodes are cleaned)

    yield from fixture.__wrapped__(node)


@pytest.mark.parametrize("env", [pytest.param({}, id="plain"), pytest.param({"KVRT_CHECK_OWNERSHIP": "1"}, id="ownership")])
def test_pd_handoff_sends_the_full_pages_and_the_last_window(pd_node, tmp_path, prompts, expected, env):
    """A P+D pair of a grouped model answers as the dense reference; P sends every block's
    full-attention page but only the sliding group's last window, so a handoff moves fewer
    bytes than a page per block and group would, and D's cache (recorded at kv-ready) serves
    the same prompts again."""
    from tests.runtime.pd.test_pd import pd_pair

    with pd_pair(pd_node, tmp_path, *WINDOWS, "--max-num-batched-tokens", "64", env=env) as (p, d):
        first = prompts[0]
        assert tokens(run_all(p.client, [first])) == expected[:1], p.logs() + d.logs()
        page = 2 * 8 * 2 * 16 * 4  # one layer's K and V of a block of 8 tokens, 2 heads of 16, float32
        blocks = -(-len(first) // 8)
        window = blocks - (len(first) - 12 + 1) // 8  # the sliding layer reads these from the first token on
        assert p.idle_stats()["pd_sent_bytes"] == (blocks + window) * page
        got = run_all(p.client, prompts)
        assert tokens(got) == expected, p.logs() + d.logs()
        pe, de = p.idle_stats(), d.idle_stats()
        assert pe["failed_requests"] == de["failed_requests"] == 0
        assert de["device_cached"] > 0 and de["device_used"] == 0 and pe["device_used"] == 0
        assert tokens(run_all(p.client, prompts, concurrent=False)) == expected


def test_pd_handoff_of_fp8_pages(pd_node, tmp_path, prompts):
    """FP8 on both sides of the handoff: a quarter of the float32 bytes, the same answers as the
    dense reference over e4m3-rounded K and V."""
    from tests.runtime.pd.test_pd import pd_pair

    want = [grouped_oracle(FP8_E4M3).generate_dense(p, NEW) for p in prompts]
    with pd_pair(pd_node, tmp_path, *WINDOWS, "--kv-cache-dtype", "fp8") as (p, d):
        first = prompts[0]
        assert tokens(run_all(p.client, [first])) == want[:1], p.logs() + d.logs()
        blocks = -(-len(first) // 8)
        window = blocks - (len(first) - 12 + 1) // 8
        assert p.idle_stats()["pd_sent_bytes"] == (blocks + window) * 2 * 8 * 2 * 16  # 1 byte an element
        assert tokens(run_all(p.client, prompts)) == want


def test_a_second_node_reads_every_groups_pages_from_storage(node, tmp_path, prompts, expected):
    """Node A writes its pages of both groups through to a file store; node B, started after
    it on the same store, reads the full pages and the sliding window before them (one task,
    all or nothing) and answers as the dense reference."""
    store = ("--num-gpu-blocks", "256", "--storage", f"file:{tmp_path / 'store'}")
    with launched(node, tmp_path / "a", *SMALL, *WINDOWS, *store) as ln:
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == expected, ln.logs()
    with launched(node, tmp_path / "b", *SMALL, *WINDOWS, *store) as ln:
        again = run_all(ln.client, prompts, concurrent=False)
        assert tokens(again) == expected, ln.logs()
        assert sum(r.cached_storage for r in again) > 0, "B must read A's pages from storage"
        assert ln.idle_stats()["device_used"] == 0
