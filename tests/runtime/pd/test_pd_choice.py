"""A prefill node's choice among several decode nodes, as a unit: the connector with a fake
context (no sockets), and decode nodes' messages sealed with a session both ends derive from
the secret, as a real decode node's are. Which decode node gets a request, what a refusal does,
and that a decode node's report of free blocks is checked before P uses it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvrt.ipc import protocol as P
from kvrt.runtime.client import api
from kvrt.runtime.pd import messages as wire
from kvrt.runtime.gateway.link import peer_identity
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.pd.auth import D2P, P2D, Session, load_secret, session_key
from kvrt.runtime.pd.connector import ConnectorContext
from kvrt.runtime.engine.sequence import SeqState
from kvrt.runtime.pd.prefill import PrefillConnector
from tests.launched import pd_secret_file

CLIENT = b"client-1"


class _Sched:
    """The scheduler verbs the connector uses: records what it adds and drops."""

    def __init__(self):
        self.added = []
        self.dropped = []
        self.inflight = None

    def add(self, seq) -> None:
        self.added.append(seq)

    def drop(self, seq, reason: str) -> None:
        seq.state = SeqState.FINISHED
        self.dropped.append((seq.request_id, reason))


class _Step:
    def __init__(self, seqs):
        self.seqs = seqs


class _Ranks:
    """A cache-messager rank's order channel: keeps the orders."""

    def __init__(self):
        self.orders = []

    def check(self, msg) -> None:
        pass

    @property
    def channel(self):
        return self

    @property
    def codec(self):
        return self

    @property
    def ring(self):
        return self

    def encode(self, msg):
        return msg

    def put(self, msg, timeout: float) -> None:
        self.orders.append(msg)


class Harness:
    """PrefillConnector over two decode nodes whose sessions are up; records what it sends."""

    def __init__(self, tmp_path):
        path = pd_secret_file(tmp_path)
        cfg = NodeConfig(node="p0", role="prefill", port=7000, decode_peer="tcp://10.0.0.2:7001,tcp://10.0.0.3:7001",
                         pd_secret_file=path, block_size=8)
        self.stats = np.zeros(len(P.STAT), dtype=np.int64)
        self.sent: list[tuple[bytes, object]] = []
        self.replies: list[tuple[bytes, object]] = []
        self.sched = _Sched()
        self.ranks = _Ranks()
        ctx = ConnectorContext(cfg=cfg, stats=self.stats, sched=self.sched, block_table=lambda rid: list(range(100, 110)),
                               reply=lambda c, m, keep=False: self.replies.append((c, m)),
                               send_raw=lambda c, m: self.sent.append((c, m)), finished=lambda seq: None,
                               count_finished=lambda seq: None, count_failed=lambda: None,
                               accepting=lambda: True, to_ranks=[self.ranks])
        self.p = PrefillConnector(ctx)
        secret = load_secret(path)
        self.d: list[Session] = []
        for link in self.p.links:  # what a welcome would set up, on both ends
            sid, nonce = bytes([link.index + 1]) * 16, bytes([link.index + 7]) * 16
            key = session_key(secret, nonce, sid, "p0")
            link.session = Session(sid, key, "p0", P2D)
            self.d.append(Session(sid, key, "p0", D2P))

    def from_d(self, i: int, msg) -> None:
        assert self.p.on_peer_message(peer_identity(i), self.d[i].seal(msg))

    def asked(self, wait: bool = False) -> list[tuple]:
        """(decode node, request id[, whether it may queue]) of every preallocation sent since
        the last call."""
        out = []
        for identity, sealed in self.sent:
            i = int(identity.removeprefix(b"\x00peer!"))
            inner = self.d[i].open(sealed)
            if isinstance(inner, wire.PdPrealloc):
                out.append((i, inner.request_id, inner.wait) if wait else (i, inner.request_id))
        self.sent.clear()
        return out


def ranks(cfg: NodeConfig, kv_cache_dtype: str = "auto") -> list[dict]:
    """A decode node's rank descriptors, as its cache-messagers publish them (the layout part),
    for blocks of `cfg`'s model with `kv_cache_dtype`."""
    layout = dataclasses.replace(cfg, kv_cache_dtype=kv_cache_dtype).kv_layout
    return [{"transport": "shm", "node": "d0", "rank": 0, "num_blocks": 64, "block_shape": list(layout.block_shape),
             "dtype": layout.storage_dtype.str, "block_bytes": layout.block_bytes}]


def request(rid: str, n: int = 40) -> api.GenerateRequest:
    return api.GenerateRequest(rid, np.arange(n, dtype=np.int32), 8)


def test_each_request_goes_to_the_decode_node_with_most_free_blocks(tmp_path):
    h = Harness(tmp_path)
    h.from_d(0, wire.PdPong(0, 10))
    h.from_d(1, wire.PdPong(0, 20))
    for i in range(3):  # 6 blocks each: 20 -> 14 -> 8, then 10 is the most
        assert h.p.on_request(CLIENT, request(f"r{i}"))
    assert h.asked() == [(1, "r0"), (1, "r1"), (0, "r2")]


def test_a_refused_request_goes_to_the_next_decode_node_then_fails_with_the_last_refusal(tmp_path):
    h = Harness(tmp_path)
    h.from_d(1, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r"))
    assert h.asked() == [(1, "r")]
    h.from_d(1, api.ErrorEvent("r", api.BAD_REQUEST, "decode node: quota"))
    assert h.asked() == [(0, "r")] and not h.replies
    h.from_d(0, api.ErrorEvent("r", api.STOPPING, "decode node: stopping"))
    assert h.asked() == [] and "r" not in h.p.pending
    assert [(c, m.code, m.message) for c, m in h.replies] == [(CLIENT, api.STOPPING, "decode node: stopping")]


def test_an_allocation_from_a_decode_node_not_asked_is_given_back(tmp_path):
    h = Harness(tmp_path)
    h.from_d(1, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r"))
    h.asked()
    h.from_d(0, wire.PdAllocated("r", np.arange(6, dtype=np.int32), 0, ranks(h.p.ctx.cfg), 30.0, 44))
    aborts = [h.d[0].open(s) for i, s in h.sent if i == peer_identity(0)]
    assert [type(m) for m in aborts] == [wire.PdAbort] and "r" in h.p.pending


@pytest.mark.parametrize("bad", ["many", -2, 1 << 40, 2.5, True])
def test_a_bad_free_blocks_report_is_refused_and_changes_nothing(tmp_path, bad):
    h = Harness(tmp_path)
    h.from_d(0, wire.PdPong(0, 10))
    h.from_d(0, wire.PdPong(0, bad))
    assert h.stats[P.STAT["pd_refused"]] == 1 and h.p.links[0].free_blocks == 10


def test_only_the_last_decode_node_left_to_try_is_asked_to_queue(tmp_path):
    """Over P's share, a decode node asked to queue would keep the request from one with room."""
    h = Harness(tmp_path)
    h.from_d(1, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r"))
    assert h.asked(wait=True) == [(1, "r", False)]
    h.from_d(1, api.ErrorEvent("r", api.BAD_REQUEST, "decode node: peer p0 is over its share"))
    assert h.asked(wait=True) == [(0, "r", True)]


def test_the_lease_counts_from_when_the_decode_node_stopped_queueing(tmp_path):
    """D's lease begins once it allocated: after P's ask plus what the request waited in D's
    queue, so P's reckoning of its end must add that wait (else a request that waited would be
    taken for one whose lease is nearly over)."""
    h = Harness(tmp_path)
    h.from_d(0, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r"))
    asked_at = h.p.pending["r"].asked_at
    h.from_d(0, wire.PdAllocated("r", np.arange(6, dtype=np.int32), 0, ranks(h.p.ctx.cfg), 30.0, 44, 12.5))
    assert h.p.handoffs["r"].lease_end == pytest.approx(asked_at + 42.5)
    assert [s.request_id for s in h.sched.added] == ["r"]


@pytest.mark.parametrize("bad", [-1.0, "x", True, 1e9])
def test_a_bad_queue_wait_is_refused(tmp_path, bad):
    h = Harness(tmp_path)
    h.from_d(0, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r"))
    h.from_d(0, wire.PdAllocated("r", np.arange(6, dtype=np.int32), 0, ranks(h.p.ctx.cfg), 30.0, 44, bad))
    assert h.stats[P.STAT["pd_refused"]] == 1 and "r" in h.p.pending and "r" not in h.p.handoffs


def test_a_request_prefills_while_its_decode_node_is_asked(tmp_path):
    """The round trip to D is hidden behind the prefill: the request is in the scheduler as
    soon as D is asked, not once D answered."""
    h = Harness(tmp_path)
    h.from_d(0, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r"))
    assert h.asked() == [(0, "r")] and [s.request_id for s in h.sched.added] == ["r"]


def test_a_prefill_done_before_the_allocation_waits_and_sends_every_block_at_once(tmp_path):
    h = Harness(tmp_path)
    h.from_d(0, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r", n=40))  # 5 blocks of 8
    seq = h.sched.added[0]
    seq.state, seq.num_computed = SeqState.RUNNING, 40
    assert h.p.takes_over(seq) and h.p.pending["r"].prefilled and not h.ranks.orders
    h.from_d(0, wire.PdAllocated("r", np.arange(6, dtype=np.int32), 8, ranks(h.p.ctx.cfg), 30.0, 44))
    [order] = h.ranks.orders  # D had the first block: the other four
    assert order.src_blocks.tolist() == [101, 102, 103, 104] and order.dst_blocks.tolist() == [1, 2, 3, 4]
    assert h.p.handoffs["r"].prefilled and not h.sched.dropped


def test_a_handoffs_last_blocks_are_ordered_when_its_first_token_is_sampled(tmp_path):
    """Before the token goes to the client (takes_over runs inside the step's results)."""
    h = Harness(tmp_path)
    h.from_d(0, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r", n=36))
    h.from_d(0, wire.PdAllocated("r", np.arange(6, dtype=np.int32), 0, ranks(h.p.ctx.cfg), 30.0, 44))
    seq = h.sched.added[0]
    seq.state, seq.num_computed = SeqState.RUNNING, 36
    assert not h.ranks.orders
    assert h.p.takes_over(seq)
    [order] = h.ranks.orders
    assert order.src_blocks.tolist() == [100, 101, 102, 103, 104]


def test_a_request_that_fails_during_its_step_ends_when_the_step_does(tmp_path):
    """Its blocks are the worker's until the step is answered: nothing is dropped before."""
    h = Harness(tmp_path)
    h.from_d(1, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r"))
    seq = h.sched.added[0]
    h.sched.inflight = _Step([seq])
    h.from_d(1, api.ErrorEvent("r", api.BAD_REQUEST, "decode node: no"))
    h.from_d(0, api.ErrorEvent("r", api.BAD_REQUEST, "decode node: no either"))
    assert not h.sched.dropped and not h.replies and "r" not in h.p.pending
    h.p.build_orders()
    assert not h.sched.dropped  # the step is still in flight
    seq.state, seq.num_computed = SeqState.RUNNING, 40
    assert h.p.takes_over(seq)  # its prefill ended in that step: parked, not decoded here
    h.sched.inflight = None
    h.p.build_orders()
    assert h.sched.dropped == [("r", "failed")]
    assert [(c, m.message) for c, m in h.replies] == [(CLIENT, "decode node: no either")]


def test_a_decode_node_whose_blocks_are_of_another_kv_dtype_is_refused_before_anything_is_sent(tmp_path):
    """An FP8 decode node cannot take a float32 prefill node's blocks (the bytes would mean
    something else there): the request fails naming the layouts, D's blocks are given back,
    and no send order goes to the cache-messagers."""
    h = Harness(tmp_path)
    h.from_d(0, wire.PdPong(0, 50))
    h.p.on_request(CLIENT, request("r"))
    h.asked()
    h.from_d(0, wire.PdAllocated("r", np.arange(6, dtype=np.int32), 0, ranks(h.p.ctx.cfg, "fp8"), 30.0, 44))
    aborts = [h.d[0].open(s) for i, s in h.sent if i == peer_identity(0)]
    assert [type(m) for m in aborts] == [wire.PdAbort] and "(float32)" in aborts[0].reason
    assert "'|u1'" in aborts[0].reason and "--kv-cache-dtype" in aborts[0].reason
    assert "r" not in h.p.handoffs and "r" not in h.p.pending and not h.ranks.orders
    assert h.sched.dropped == [("r", "failed")]
