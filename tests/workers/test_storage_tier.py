"""The file tier end to end: objects a node wrote that were corrupted or truncated since are
never served as KV (the prefix ends at the first bad one and the rest is recomputed, with the
dense reference's answers), recomputed objects are written again, and a capped tier stays
under its cap while it serves."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.node.config import NodeConfig
from tests.launched import SMALL, launched, oracle, pd_secret_file, shared_prefix_prompts
from kvrt.workers.storage.base import FileStorage

pytestmark = pytest.mark.e2e

NEW = 4
BS = 8  # SMALL's block size


def block_keys(prompt: np.ndarray) -> list[bytes]:
    """The keys a node launched with SMALL gives the prompt's full blocks."""
    root = NodeConfig(node="x", num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS).key_root
    hasher = BlockHasher(BS, root)
    hasher.update(prompt)
    return hasher.keys


@pytest.mark.parametrize("planter", ["unsigned", "another secret"])
def test_planted_objects_with_a_valid_checksum_are_recomputed_not_served(node, tmp_path, planter):
    """Whoever else can write into the directory replaces a signed node's objects with its own
    blocks, checksummed as the tier wants them but without the group's MAC (or with another
    group's): the node computes those blocks (right answers) and counts the one that ended its
    prefix, which it removes and so writes again (the next is found by the next read)."""
    from kvrt.workers.storage.mac import BlockMac

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 512, 4 * BS + 3).astype(np.int32)
    store = str(tmp_path / "store")
    opts = (*SMALL, "--num-gpu-blocks", "64", "--storage", f"file:{store}",
            "--storage-secret-file", pd_secret_file(tmp_path, "store"))
    want = oracle().generate_dense(prompt, NEW)
    with launched(node, tmp_path / "a", *opts) as ln:
        assert ln.client.generate(prompt, NEW).output_token_ids.tolist() == want
        ln.idle_stats()
    forger = FileStorage(store, 0, mac=None if planter == "unsigned" else BlockMac(b"x" * 32, b"whatever"))
    keys = block_keys(prompt)
    shape = NodeConfig(node="x", num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS).block_shape
    for k in keys:
        forger.put(k, rng.standard_normal(shape).astype(np.float32))
    with launched(node, tmp_path / "b", *opts) as ln:
        res = ln.client.generate(prompt, NEW)
        stats = ln.idle_stats()
    assert res.output_token_ids.tolist() == want and res.cached_storage == 0
    assert stats["storage_forged"] == 1, "the first forged object ends the prefix"
    assert stats["storage_errors"] == 0 and stats["failed_requests"] == 0
    with launched(node, tmp_path / "c", *opts) as ln:
        res = ln.client.generate(prompt, NEW)
        stats = ln.idle_stats()
    assert res.output_token_ids.tolist() == want
    assert res.cached_storage == BS and stats["storage_forged"] == 1, \
        "the forged object that was read was removed and written again; the next one ends the prefix now"


def test_corrupted_and_truncated_objects_are_recomputed_not_served(node, tmp_path):
    rng = np.random.default_rng(3)
    p1, p2 = (rng.integers(0, 512, 6 * BS + 3).astype(np.int32) for _ in range(2))
    store = str(tmp_path / "store")
    opts = (*SMALL, "--num-gpu-blocks", "64", "--storage", f"file:{store}")
    want = [oracle().generate_dense(p, NEW) for p in (p1, p2)]
    with launched(node, tmp_path / "a", *opts) as ln:
        assert [ln.client.generate(p, NEW).output_token_ids.tolist() for p in (p1, p2)] == want
        ln.idle_stats()
    files = FileStorage(store, 0)
    k1, k2 = block_keys(p1), block_keys(p2)
    assert all(files.contains(k) for k in k1 + k2), "every full block was written through"
    path = files.path(k1[2])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10  # one bit of the KV payload
    open(path, "wb").write(bytes(data))
    path = files.path(k2[1])
    open(path, "wb").write(open(path, "rb").read()[:-7])
    with launched(node, tmp_path / "b", *opts) as ln:
        res = [ln.client.generate(p, NEW) for p in (p1, p2)]
        assert [r.output_token_ids.tolist() for r in res] == want, ln.logs()
        assert [r.cached_storage for r in res] == [2 * BS, 1 * BS], "the prefix ends at the damaged object"
        assert [r.computed_prompt_tokens for r in res] == [len(p1) - 2 * BS, len(p2) - BS]
        assert ln.idle_stats()["storage_errors"] == 2, "each damaged object is counted"
    with launched(node, tmp_path / "c", *opts) as ln:  # the recomputed blocks were written again
        res = [ln.client.generate(p, NEW) for p in (p1, p2)]
        assert [r.output_token_ids.tolist() for r in res] == want
        assert [r.cached_storage for r in res] == [6 * BS, 6 * BS]


def test_a_capped_file_tier_stays_under_its_cap_while_it_serves(node, tmp_path):
    prompts = shared_prefix_prompts(seed=9, systems=3, users=3)
    block_bytes = 2 * 2 * BS * 2 * 16 * 4
    cap = 12 * (block_bytes + 24)  # room for 12 objects (24: the header)
    store = str(tmp_path / "store")
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64", "--storage",
                  f"file:{store}?max_bytes={cap}") as ln:
        res = [ln.client.generate(p, NEW) for p in prompts]
        assert ln.idle_stats()["tasks_failed"] == 0
    assert [r.output_token_ids.tolist() for r in res] == [oracle().generate_dense(p, NEW) for p in prompts]
    files = FileStorage(store, 0)
    used = sum(os.path.getsize(files.path(k)) for k in files.keys())
    assert 0 < used <= cap


def test_bench_storage_json_quick():
    """`kvrt bench storage --json`: every tier's put and get against the socket (the cross-node
    part launches three nodes: tests/workers/test_storage_mooncake.py covers what it measures)."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO
    from kvrt.workers.storage.mooncake import unavailable_reason

    out = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "storage", "--json", "--batch", "4",
                          "--repeat", "1", "--num-layers", "1", "--num-kv-heads", "2", "--head-dim", "16",
                          "--no-cross-node", "--memory", "64M"],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    tiers = {(r["tier"], r["op"]) for r in res["io"]}
    want = {"socket", "file", "file+mac"} | ({"mooncake", "mooncake+mac"} if unavailable_reason() is None else set())
    assert tiers == {(t, op) for t in want for op in ("put", "get")}
    assert all(r["gb_s"] > 0 and r["vs_socket"] > 0 for r in res["io"]) and res["cross_node"] == []
