"""Decode-node quotas that protect without refusing the legitimate, and peer-scoped prefix
caching.

- A prefill node alone on a decode node at default settings: a burst far over what D's pool
  holds at once waits for blocks, is never refused, and every answer equals a mixed node's
  greedy tokens (the dense reference).
- Shares: a peer alone may hold the whole pool; a peer over its share waits (in order) until
  its own blocks come back, fails only when its wait ends (the error says what it waited for);
  a second peer is guaranteed its part.
- A peer's blocks serve only that peer: KV a peer wrote (here: never wrote, so the blocks hold
  whatever was there) is found by neither D's own clients nor another peer.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvrt.runtime.client import api
from kvrt.runtime.pd import messages as wire
from kvrt.runtime.pd.auth import load_secret
from kvrt.runtime.pd.decode import fair_share
from tests.launched import SMALL, launched, oracle, pd_secret_file
from tests.runtime.engine.test_oracle import run_all, tokens
from tests.runtime.pd.test_pd import pd_node, pd_pair, wait_for  # noqa: F401  (pd_node: a fixture)
from tests.runtime.pd.test_pd_multi import answers, multi_node, pd_nodes  # noqa: F401  (multi_node: a fixture)
from tests.runtime.pd.test_pd_security import FakePeer, prompt

NEW = 8


def burst(n: int, seed: int = 41) -> list[np.ndarray]:
    """`n` prompts of 60..120 tokens (9..16 blocks of 8 with their new tokens), sharing four
    heads: together several times D's default pool of 512 blocks."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, 512, 48) for _ in range(4)]
    return [np.concatenate([heads[i % 4], rng.integers(0, 512, rng.integers(12, 72))]).astype(np.int32)
            for i in range(n)]


@pytest.mark.e2e
def test_a_burst_over_the_pool_waits_instead_of_being_refused(pd_node, tmp_path):
    """200 requests at once through P, default quotas (they once refused part of such a burst:
    16 preallocations waiting, half the pool per peer)."""
    prompts = burst(200)
    model = oracle()
    want = [model.generate_dense(p, NEW) for p in prompts]
    with pd_pair(pd_node, tmp_path) as (p, d):
        got = run_all(p.client, prompts, new=NEW)
        assert tokens(got) == want
        ps, ds = p.idle_stats(), d.idle_stats()
        assert ps["failed_requests"] == 0 and ds["failed_requests"] == 0 and ds["pd_refused"] == 0, (ps, ds)
        assert ds["finished_requests"] == len(prompts)


@pytest.mark.e2e
def test_two_prefill_nodes_bursting_on_one_decode_node_are_all_served(multi_node, tmp_path):
    """Two P's send 60 requests each at once to one D at default settings (each burst alone
    more than D's pool): D shares its pool between them, refuses nothing, and every answer
    is the reference."""
    prompts = burst(60, seed=43)
    model = oracle()
    want = [model.generate_dense(p, NEW) for p in prompts]
    secret = pd_secret_file(tmp_path)
    with pd_nodes(multi_node, tmp_path, secret, ((),), ((), ())) as ((d,), (p0, p1)):
        ids = [[c.submit(q, NEW) for q in prompts] for c in (p0.client, p1.client)]
        for client, mine in zip((p0.client, p1.client), ids):
            assert answers(client, mine) == want
        ds = d.idle_stats()
        assert ds["finished_requests"] == 2 * len(prompts) and ds["pd_refused"] == 0, ds


@contextlib.contextmanager
def decode_node(node: str, tmp_path, *opts: str):
    """A decode node (64 blocks of 8; a wait for blocks ends after 3 s) and a factory of
    authenticated fake peers on it."""
    secret = pd_secret_file(tmp_path)
    with launched(node + "d", tmp_path / "d", "--role", "decode", *SMALL, "--num-gpu-blocks", "64",
                  "--pd-timeout", "4", "--rank-timeout", "1", "--pd-secret-file", secret, *opts) as d:
        with contextlib.ExitStack() as stack:
            def peer(name: str) -> FakePeer:
                fake = stack.enter_context(contextlib.closing(FakePeer(d.port, load_secret(secret), name)))
                fake.handshake()
                return fake

            yield d, peer


def ask(peer: FakePeer, rid: str, seed: int, n: int = 200, wait: bool = True) -> None:
    """A preallocation of 26 blocks (200 tokens and 8 new ones) by default."""
    peer.send(wire.PdPrealloc(rid, prompt(seed, n), 8, wait=wait))


def allocated(msg, rid: str) -> wire.PdAllocated:
    assert isinstance(msg, wire.PdAllocated) and msg.request_id == rid, msg
    return msg


@pytest.mark.alone  # b1's 3 s wait for blocks must outlast the way of a's give-back to D
@pytest.mark.e2e
def test_a_peer_over_its_share_waits_and_a_second_peer_gets_its_part(pd_node, tmp_path):
    with decode_node(pd_node, tmp_path) as (d, peer):
        a = peer("a-" + os.urandom(2).hex())
        ask(a, "a1", 1)
        allocated(a.recv(), "a1")
        ask(a, "a2", 2)  # 52 of 64 blocks: alone, a peer may use the whole pool
        allocated(a.recv(), "a2")
        ask(a, "a0", 6)  # queued, then given back: it is never allocated (a3 is, below)
        a.send(wire.PdAbort("a0"))
        ask(a, "a3", 3, wait=False)  # over: refused at once when P says it has another decode node
        err = a.recv()
        assert isinstance(err, api.ErrorEvent) and "share of 64" in err.message, err
        ask(a, "a3", 3)  # queued, not refused: the first answer is its allocation once a1 is given back
        a.send(wire.PdAbort("a1"))
        assert allocated(a.recv(), "a3").waited_s > 0

        b = peer("b-" + os.urandom(2).hex())
        ask(b, "b1", 4)  # within b's part (32), waits for the pool: a holds 52 blocks
        ask(a, "a4", 5)  # a is over its share now (64 - 26 for b): queued behind
        a.send(wire.PdAbort("a2"))
        allocated(b.recv(), "b1")
        err = a.recv()  # a4 waits until its wait ends, and is told why
        assert isinstance(err, api.ErrorEvent) and err.request_id == "a4" and err.code == "failed", err
        assert "waited" in err.message and "share of 38" in err.message, err.message
        a.send(wire.PdAbort("a3"))
        b.send(wire.PdAbort("b1"))
        stats = d.idle_stats()
        assert stats["device_used"] == 0 and stats["pd_refused"] == 1, stats


@pytest.mark.e2e
def test_blocks_a_peer_wrote_serve_that_peer_only(pd_node, tmp_path):
    """Peer X preallocates a prompt and says kv-ready without writing any KV (a forgery: the
    blocks hold whatever was there). D's own client and peer Y, asking for the same prompt,
    hit none of X's blocks, and the client gets the right tokens; X itself hits them."""
    forged = prompt(20, 68)  # 8 full blocks and a partial one
    with decode_node(pd_node, tmp_path) as (d, peer):
        x = peer("x-" + os.urandom(2).hex())
        x.send(wire.PdPrealloc("f", forged, 2))
        allocated(x.recv(), "f")
        x.send(wire.PdKvReady("f", 7))
        while not isinstance(msg := x.recv(), api.FinishedEvent):
            assert isinstance(msg, api.TokenEvent), msg
        wait_for(lambda: d.engine_stats()["device_cached"] >= 8, "D to cache X's blocks")

        result = d.client.generate(forged, 6)
        assert result.cached_tokens == 0, "D's client hit blocks a peer wrote"
        assert list(result.output_token_ids) == list(oracle().generate_dense(forged, 6))

        y = peer("y-" + os.urandom(2).hex())
        y.send(wire.PdPrealloc("g", forged, 2))
        assert allocated(y.recv(), "g").cached_tokens == 0, "peer Y hit blocks peer X wrote"
        y.send(wire.PdAbort("g"))

        x.send(wire.PdPrealloc("h", forged, 2))
        assert allocated(x.recv(), "h").cached_tokens == 64, "X's own blocks serve X"
        x.send(wire.PdAbort("h"))
        assert d.idle_stats()["device_used"] == 0


@given(total=st.integers(1, 10_000), limit=st.integers(1, 10_000),
       others=st.lists(st.integers(0, 20_000), max_size=8))
def test_fair_share_guarantees_each_peer_its_part(total, limit, others):
    share = fair_share(total, limit, others)
    needing = [o for o in others if o > 0]
    assert 0 <= share <= min(total, limit)
    assert share >= min(limit, total // (len(needing) + 1)), "every peer gets its equal part"
    if not needing:
        assert share == min(total, limit), "a peer alone may use the whole pool"
    # what this peer may take leaves every other peer its need, up to its equal part
    part = total // (len(needing) + 1)
    assert share + sum(min(o, part) for o in needing) <= total
