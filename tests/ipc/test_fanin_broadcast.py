import pytest

from kvrt.ipc.errors import WaitTimeout
from kvrt.ipc.fanin import FanIn
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Consumer, Producer, Ring


def test_fan_in_is_fair_and_wakes_on_any_ring(node):
    with Registry.create(node) as reg:
        reg.create_doorbell("bell")
        for i in range(3):
            Ring.create(reg, f"in.{i}", capacity=1 << 14, bell="bell")
        prods = [Producer.attach(reg, f"in.{i}") for i in range(3)]
        cons = [Consumer.attach(reg, f"in.{i}") for i in range(3)]
        fan = FanIn(cons)
        for i, p in enumerate(prods):
            p.put_many([f"{i}:{k}".encode() for k in range(4)], 1)
        order = [fan.get(1)[0] for _ in range(12)]
        assert order == [0, 1, 2] * 4  # round robin while all have records
        with pytest.raises(WaitTimeout, match="any producer"):
            fan.get(0.1)
        prods[2].put(b"late", 1)
        assert fan.get(1) == (2, b"late")
        Ring.create(reg, "own", capacity=4096)  # its own doorbell: cannot join this fan-in
        own = Consumer.attach(reg, "own")
        with pytest.raises(ValueError, match="share one doorbell"):
            FanIn([cons[0], own])
        for x in prods + cons + [own]:
            x.detach()
