"""A wait's bounded spin (`spin_s`, what a GPU node's engine and cache-transfer set from
--wait-spin-us): a record that arrives within it is taken spinning, without a yield or a sleep on
the doorbell; without it the same wait yields first. The arrival is staged on the poll count,
not on a clock, so nothing here depends on timing."""
from __future__ import annotations

import os

import pytest

from kvrt.ipc.fanin import FanIn
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import SPINS, YIELDS, Consumer, Producer, Ring, spin_for


@pytest.fixture
def ends(node):
    with Registry.create(node) as reg:
        reg.create_doorbell("bell")
        Ring.create(reg, "r", capacity=4096, bell="bell")
        p, c = Producer.attach(reg, "r"), Consumer.attach(reg, "r")
        yield p, c
        p.detach()
        c.detach()


@pytest.fixture
def yields(monkeypatch):
    seen: list[int] = []
    real = os.sched_yield
    monkeypatch.setattr(os, "sched_yield", lambda: (seen.append(1), real())[1])
    return seen


def arrive_at(poll: int, p: Producer, probe):
    """A `probe` (the consumer's readiness check) that puts a record on its `poll`-th call."""
    calls = [0]

    def ready(*args):
        calls[0] += 1
        if calls[0] == poll:
            p.put(b"x", 1)
        return probe(*args)

    return ready


@pytest.mark.parametrize("spin_s, yielded", [(60.0, 0), (0.0, YIELDS)])
def test_a_ring_wait_spins_before_it_yields(ends, yields, spin_s, yielded):
    p, c = ends
    c._readable = arrive_at(SPINS + YIELDS + 10, p, c._readable)  # past the polls and yields without a spin
    c.spin_s = spin_s
    assert c.get(5) == b"x"
    assert len(yields) == yielded


@pytest.mark.parametrize("spin_s, yielded", [(60.0, 0), (0.0, YIELDS)])
def test_the_fan_in_spins_before_it_yields(ends, yields, spin_s, yielded):
    p, c = ends
    fan = FanIn([c])
    fan.try_get = arrive_at(SPINS // 4 + YIELDS + 10, p, fan.try_get)
    fan.spin_s = spin_s
    assert fan.get(5) == (0, b"x")
    assert len(yields) == yielded


def test_a_poke_ends_the_fan_ins_spin(ends):
    _, c = ends
    fan = FanIn([c])
    fan.spin_s = 60.0
    real = fan.try_get
    fan.try_get = lambda: (fan.poke(), real())[1]
    assert fan.get(5) is None


def test_spin_for():
    calls = [0]

    def third() -> bool:
        calls[0] += 1
        return calls[0] >= 3

    assert spin_for(third, 60.0) and calls[0] == 3
    assert not spin_for(lambda: False, 0.001)
    assert not spin_for(lambda: True, 0.0)  # no time: not even one poll
