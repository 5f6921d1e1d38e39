import os
import random
import signal
import time

import pytest

from kvrt.ipc.errors import ChannelClosed, PeerDead, RecordTooLarge, WaitTimeout
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Consumer, Producer, Ring
from tests.conftest import spawn_py


@pytest.fixture
def ring(node):
    with Registry.create(node) as reg:
        Ring.create(reg, "r", capacity=4096)
        p, c = Producer.attach(reg, "r"), Consumer.attach(reg, "r")
        yield reg, p, c
        p.detach()
        c.detach()


def test_put_get_in_order(ring):
    _, p, c = ring
    p.put(b"hello", 1)
    p.put(b"", 1)
    p.put_many([b"a", b"bb", b"ccc"], 1)
    assert c.get(1) == b"hello"
    assert c.get(1) == b""
    assert c.get_many(10, 1) == [b"a", b"bb", b"ccc"]
    assert c.try_get() is None
    st = c.stats()
    assert st["records_in"] == st["records_out"] == 5 and st["depth_bytes"] == 0


def test_random_sizes_wrap_around_against_a_model(ring):
    _, p, c = ring
    rng = random.Random(7)
    model: list[bytes] = []
    for step in range(20000):
        if rng.random() < 0.55:
            rec = rng.randbytes(rng.choice([0, 1, 7, 8, 100, rng.randint(0, p.max_record)]))
            try:
                p.put(rec, 0.0)
                model.append(rec)
            except WaitTimeout:
                assert model  # only a non-empty ring can be full
        elif model:
            if rng.random() < 0.5:
                assert c.get(0.0) == model.pop(0)
            else:
                got = c.get_many(rng.randint(1, 5), 0.0)
                assert got == model[: len(got)]
                del model[: len(got)]
    assert list(iter(c.try_get, None)) == model  # the rest, without waiting


def test_oversize_refused_before_anything_is_written(ring):
    _, p, c = ring
    assert p.max_record == 4096 // 2 - 8
    p.put(b"x" * p.max_record, 1)  # the largest record fits
    with pytest.raises(RecordTooLarge):
        p.put(b"x" * (p.max_record + 1), 1)
    with pytest.raises(RecordTooLarge):
        p.put_many([b"ok", b"x" * 5000], 1)
    assert c.stats()["records_in"] == 1
    assert c.get(1) == b"x" * p.max_record and c.try_get() is None


def test_full_ring_waits_then_times_out_naming_the_consumer(ring):
    _, p, c = ring
    p.put(b"x" * 2000, 1)
    p.put(b"x" * 2000, 1)
    t = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"space.*consumer \(pid"):
        p.put(b"x" * 200, 0.2)
    assert time.monotonic() - t >= 0.2
    c.get(1)
    p.put(b"x" * 200, 1)  # never dropped: space came back


def test_empty_ring_times_out_naming_the_producer(ring):
    _, p, c = ring
    with pytest.raises(WaitTimeout, match=r"waiting for a record from the producer"):
        c.get(0.1)


def test_closed_ring_ends_the_wait(ring):
    reg, p, c = ring
    p.put(b"last", 1)
    p2 = Producer.attach(reg, "r")
    p2.close()
    assert c.get(1) == b"last"  # records already there are still delivered
    with pytest.raises(ChannelClosed):
        c.get(5)


SLOW_PRODUCER = """
import sys, time
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Producer
p = Producer.attach(Registry.attach(sys.argv[1]), "r")
p.put(b"first", 1)
print("ready", flush=True)
time.sleep(60)
"""

ECHO = """
import sys
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Producer, Consumer
reg = Registry.attach(sys.argv[1])
c, p = Consumer.attach(reg, "ping"), Producer.attach(reg, "pong")
while True:
    m = c.get(30)
    if m == b"stop":
        break
    p.put(m, 30)
p.close()
c.detach()
"""


@pytest.mark.alone
@pytest.mark.e2e
def test_dead_producer_ends_the_wait_and_a_new_one_takes_over(ring):
    reg, p, c = ring
    p.detach()
    proc = spawn_py(SLOW_PRODUCER, reg.node)
    assert proc.stdout.readline().strip() == "ready"
    assert c.get(5) == b"first"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t = time.monotonic()
    with pytest.raises(PeerDead, match=f"producer \\(pid {proc.pid}\\) is dead"):
        c.get(30)
    assert time.monotonic() - t < 2.0
    p2 = Producer.attach(reg, "r")
    p2.put(b"again", 1)
    assert c.get(1) == b"again"
    p2.detach()


@pytest.mark.e2e
def test_dead_consumer_ends_a_full_ring_wait(ring):
    reg, p, c = ring
    c.detach()
    code = "import sys,time\nfrom kvrt.ipc.registry import Registry\nfrom kvrt.ipc.ring import Consumer\n" \
           "Consumer.attach(Registry.attach(sys.argv[1]), 'r')\nprint('ready', flush=True)\ntime.sleep(60)"
    proc = spawn_py(code, reg.node)
    assert proc.stdout.readline().strip() == "ready"
    p.put(b"x" * 2000, 1)
    p.put(b"x" * 2000, 1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with pytest.raises(PeerDead, match="consumer"):
        p.put(b"x" * 2000, 30)


@pytest.mark.e2e
def test_ping_pong_with_a_real_process(node):
    with Registry.create(node) as reg:
        Ring.create(reg, "ping", capacity=1 << 16)
        Ring.create(reg, "pong", capacity=1 << 16)
        p, c = Producer.attach(reg, "ping"), Consumer.attach(reg, "pong")
        proc = spawn_py(ECHO, node)
        for i in range(2000):
            msg = os.urandom(i % 300)
            p.put(msg, 10)
            assert c.get(10) == msg
        p.put(b"stop", 10)
        with pytest.raises(ChannelClosed):
            c.get(10)
        assert proc.wait(10) == 0
        p.detach()
        c.detach()


def test_bad_capacity(node):
    with Registry.create(node) as reg:
        for cap in (1000, 1024, 5000):
            with pytest.raises(ValueError):
                Ring.create(reg, f"bad{cap}", capacity=cap)
