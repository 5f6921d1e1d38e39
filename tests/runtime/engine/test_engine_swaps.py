"""The engine applying real cache-transfer results to its prefix cache: blocks evicted from a
tiny device pool go to the host pool (SWAP2CPU) and come back on a later hit (SWAP2GPU) through
real cache-transfer processes, with checksummed contents and the pool invariants intact."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from kvrt.ipc import protocol as P
from kvrt.ipc.member import Member
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.engine.engine import Engine
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.node.supervisor import Node
from tests.conftest import REPO
from kvrt.workers.kv_pool import PoolMaker, attach_pools

pytestmark = pytest.mark.e2e

BS = 16


@pytest.fixture
def engine(node):
    cfg = NodeConfig(node, tp=2, block_size=BS, num_gpu_blocks=6, num_cpu_blocks=16, rank_timeout=10,
                     num_layers=2, num_kv_heads=2, head_dim=8).validate()
    n = Node(cfg, PoolMaker(), progress=lambda m: None)
    n.create_objects()
    procs = [subprocess.Popen([sys.executable, "-m", "kvrt.workers.cache_transfer", "--node", node, "--rank", str(r)],
                              cwd=REPO) for r in range(cfg.tp)]
    member = None
    try:
        member = Member.join(node, P.ROLE_ENGINE, 0)
        eng = Engine(member)
        ready = member.ready.array
        deadline = time.monotonic() + 30
        while not all(ready[P.slot_of(cfg.tp, P.ROLE_TRANSFER, r)] for r in range(cfg.tp)):
            assert time.monotonic() < deadline, "cache-transfer ranks did not get ready"
            eng.step()
        pools = [attach_pools(n.reg, r, cfg) for r in range(cfg.tp)]
        yield eng, [p[0] for p in pools]
        eng.shutdown(grace_s=5)
        for p in procs:
            assert p.wait(10) == 0
        for dev, host in pools:
            dev.close()
            host.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if member is not None:
            member.leave()
        n.unlink()


def settle(eng: Engine) -> None:
    deadline = time.monotonic() + 20
    eng.tasks.issue()
    while eng.transfer.inflight or eng.cache.snapshot()["tasks_inflight"]:
        assert time.monotonic() < deadline, "transfer tasks did not finish"
        eng.step()


def compute(eng: Engine, devs, rid: str, tokens: np.ndarray) -> None:
    """Admit, 'compute' (write a pattern derived from the tokens into every rank's blocks), record, release."""
    keys = BlockHasher(BS).update(tokens)
    m = eng.cache.match(rid, keys, len(tokens))
    settle(eng)
    while eng.cache.allocate(rid, len(tokens)) is None:
        settle(eng)
    table = eng.cache.block_table(rid)
    for b in range(m.cached_tokens // BS, len(tokens) // BS):
        for r, dev in enumerate(devs):
            dev.array[table[b]] = pattern(tokens, b, r)
    eng.cache.update(rid, len(tokens))
    eng.cache.release(rid)
    settle(eng)


def pattern(tokens: np.ndarray, block: int, rank: int) -> float:
    return float(int(tokens[block * BS]) * 10 + rank)


def test_evicted_blocks_swap_out_and_back_with_their_contents(engine):
    eng, devs = engine
    a = np.arange(0, 4 * BS, dtype=np.int32)
    compute(eng, devs, "a", a)
    compute(eng, devs, "b", np.arange(1000, 1000 + 4 * BS, dtype=np.int32))  # evicts a's blocks to host
    snap = eng.cache.snapshot()
    assert snap["swap_out_blocks"] >= 2 and snap["host_cached"] >= 2
    keys = BlockHasher(BS).update(np.concatenate([a, np.arange(5000, 5000 + BS, dtype=np.int32)]))
    m = eng.cache.match("a2", keys, 5 * BS)
    assert m.host_tokens >= 2 * BS  # a's prefix is found on the host ...
    settle(eng)
    assert eng.cache.is_ready("a2")  # ... and swapped back in by the real ranks
    table = eng.cache.block_table("a2")
    for b in range((m.device_tokens + m.host_tokens) // BS):
        for r, dev in enumerate(devs):
            assert (dev.array[table[b]] == pattern(a, b, r)).all(), f"block {b} rank {r} corrupted"
    eng.cache.release("a2")
    settle(eng)
    eng.cache.check()
    st = eng.stats.array
    assert st[P.STAT["tasks_done"]] >= 2 and st[P.STAT["tasks_failed"]] == 0 and st[P.STAT["swap_bytes"]] > 0
    assert st[P.STAT["host_total"]] == 16 and st[P.STAT["hit_tokens_host"]] >= 2 * BS
