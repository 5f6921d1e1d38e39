import pytest

from ipc.broadcast import Broadcast
from ipc.errors import WaitTimeout
from ipc.fanin import FanIn
from ipc.registry import Registry
from ipc.ring import Consumer, Producer, Ring


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


def test_broadcast_gathers_every_rank_and_names_the_silent_one(node):
    with Registry.create(node) as reg:
        for r in range(3):
            Ring.create(reg, f"task.{r}", capacity=4096)
            Ring.create(reg, f"done.{r}", capacity=4096)
        bc = Broadcast([Producer.attach(reg, f"task.{r}") for r in range(3)],
                       [Consumer.attach(reg, f"done.{r}") for r in range(3)])
        ranks = [(Consumer.attach(reg, f"task.{r}"), Producer.attach(reg, f"done.{r}")) for r in range(3)]
        bc.put(b"swap 1", 1)
        for r, (tasks, done) in enumerate(ranks):
            assert tasks.get(1) == b"swap 1"
            done.put(f"ok {r}".encode(), 1)
        assert bc.gather(1) == [b"ok 0", b"ok 1", b"ok 2"]
        bc.put(b"swap 2", 1)
        for r in (0, 2):  # rank 1 stays silent
            ranks[r][0].get(1)
            ranks[r][1].put(b"ok", 1)
        with pytest.raises(WaitTimeout, match=r"rank\(s\) \[1\]"):
            bc.gather(0.2)
        for x in bc.out + bc.back + [e for pair in ranks for e in pair]:
            x.detach()
