"""The node's declaration: every object once, every channel with one writer and one reader, and
what each process opens is what the creator made."""
from __future__ import annotations

from collections import Counter

import pytest

from kvrt.ipc import protocol as P
from kvrt.ipc.config import NodeConfig
from kvrt.ipc.registry import Registry
from kvrt.ipc.topology import ENGINE, GATEWAY, NODE_SIGNALS, Topology

CONFIGS = {
    "mixed": dict(),
    "mixed tp2, host tier": dict(tp=2, num_cpu_blocks=8),
    "storage only": dict(storage="file:///tmp/kvrt-store"),
    "prefill tp2, host tier, ownership": dict(tp=2, role="prefill", num_cpu_blocks=8, check_ownership=True,
                                              port=5555, decode_peer="tcp://127.0.0.1:5556"),
    "decode": dict(role="decode", port=5556),
    "mixed, KV events only": dict(kv_events_port=5557),
    "checkpoint tp2": dict(tp=2, model_dir="/m", hidden_size=64),
}


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def cfg(request) -> NodeConfig:
    return NodeConfig(node="topo", **CONFIGS[request.param])


def test_every_name_is_declared_once(cfg):
    names = Topology.of(cfg).names()
    assert [n for n, k in Counter(names).items() if k > 1] == []
    assert set(NODE_SIGNALS) <= set(names)


def test_each_channel_joins_the_engine_to_one_declared_process(cfg):
    topo = Topology.of(cfg)
    for link in topo.links:
        assert (link.producer == ENGINE) != (link.consumer == ENGINE), link.channel.obj
        assert link.peer() in topo.processes
    # ... and is one process's writing end and exactly one other's reading end
    sent = Counter(k.channel.obj for p in topo.processes for k in topo.sends(p))
    read = Counter(k.channel.obj for p in topo.processes for k in topo.receives(p))
    assert sent == read == Counter(k.channel.obj for k in topo.links)
    assert set(sent.values()) == {1}


def test_the_roles_follow_the_configuration(cfg):
    topo = Topology.of(cfg)
    roles = {role for role, _ in topo.processes}
    assert (P.ROLE_TRANSFER in roles) == cfg.needs_transfer
    assert (P.ROLE_MESSAGER in roles) == cfg.disaggregated
    assert sorted(r for role, r in topo.processes if role == P.ROLE_WORKER) == list(range(cfg.tp))
    assert (topo.allreduce is not None) == cfg.needs_allreduce
    assert (P.OWNERS_DEVICE in topo.names()) == cfg.check_ownership
    for role, rank in topo.processes:  # a rank process has an order channel in and an answer channel out
        if role not in (P.ROLE_ENGINE, P.ROLE_GATEWAY):
            assert len(topo.receives((role, rank))) == len(topo.sends((role, rank))) == 1
    # the gateway: when the node listens where others reach it; no ring (private sockets instead)
    assert (GATEWAY in topo.processes) == bool(cfg.port or cfg.kv_events_port)
    assert not topo.sends(GATEWAY) and not topo.receives(GATEWAY)


def test_the_engine_waits_on_every_answer_with_one_bell(cfg):
    topo = Topology.of(cfg)
    assert {k.bell for k in topo.receives(ENGINE)} == {P.ENGINE_BELL}
    assert {k.bell for k in topo.sends(ENGINE)} == {None}


def test_narrowed_to_one_role_the_node_has_only_its_channels():
    topo = Topology.of(NodeConfig(node="topo", tp=2, num_cpu_blocks=8, role="decode"), roles=[P.ROLE_TRANSFER])
    assert topo.processes == (ENGINE, (P.ROLE_TRANSFER, 0), (P.ROLE_TRANSFER, 1))
    assert [k.channel.obj for k in topo.sends(ENGINE)] == [P.to_transfer(0), P.to_transfer(1)]


@pytest.mark.parametrize("name", ["mixed tp2, host tier", "prefill tp2, host tier, ownership", "checkpoint tp2"])
def test_what_each_process_opens_is_what_the_creator_created(node, name):
    cfg = NodeConfig(node=node, **CONFIGS[name])
    topo = Topology.of(cfg)
    with Registry.create(node) as reg:
        signals = topo.create(reg, 4096)
        try:
            created = {e.name.split(".", 2)[2] for e in reg.entries()}
            assert created == set(topo.names()) - {P.CONFIG, *topo.pools}
            for proc in topo.processes:
                ends = topo.senders(reg, proc) + topo.receivers(reg, proc)
                assert sorted(e.channel.obj for e in ends) == sorted(
                    k.channel.obj for k in topo.links if proc in (k.producer, k.consumer))
                for end in ends:
                    end.detach()
        finally:
            for s in signals.values():
                s.close()
