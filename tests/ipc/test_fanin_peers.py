"""A fan-in reports a producer that died before it ever attached its ring, once the creator
named it (as the launcher does for every child it starts)."""
import signal
import time

import pytest

from kvrt.ipc.errors import PeerDead, WaitTimeout
from kvrt.ipc.fanin import FanIn
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Consumer, Producer, Ring
from tests.conftest import spawn_py

pytestmark = pytest.mark.e2e


def test_a_producer_killed_before_it_attached_is_reported(node):
    with Registry.create(node) as reg:
        reg.create_doorbell("bell")
        for i in range(2):
            Ring.create(reg, f"in.{i}", capacity=1 << 14, bell="bell")
        live = Producer.attach(reg, "in.0")
        late = spawn_py("import time\nprint('up', flush=True)\ntime.sleep(60)")  # would attach in.1 later
        assert late.stdout.readline().strip() == "up"
        Ring.assign(reg.find("in.1"), producer=late.pid)
        fan = FanIn([Consumer.attach(reg, f"in.{i}") for i in range(2)], check_every=0.05)
        live.put(b"x", 1)
        assert fan.get(1) == (0, b"x")
        late.send_signal(signal.SIGKILL)
        late.wait()
        with pytest.raises(PeerDead, match=f"producer \\(pid {late.pid}\\) is dead") as err:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    fan.get(0.2)
                except WaitTimeout:
                    pass
        assert err.value.index == 1
        for c in fan.consumers:
            c.detach()
        live.detach()
