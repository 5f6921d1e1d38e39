import numpy as np
import pytest

from kvrt.ipc.errors import IpcError
from kvrt.ipc.registry import Registry
from kvrt.ipc.signals import Signal
from tests.conftest import spawn_py

ADD = """
import sys
from kvrt.ipc.registry import Registry
from kvrt.ipc.signals import Signal
reg = Registry.attach(sys.argv[1])
s = Signal.attach(reg, "counters")
for _ in range(20000):
    s.add(0)
    s.add((1, 1), 2)
"""


def test_create_attach_share_values(node):
    with Registry.create(node) as reg:
        s = Signal.create(reg, "status", (2, 3), dtype=np.int32, fill=-1)
        t = Signal.attach(reg, "status")
        assert t.array.shape == (2, 3) and t.array.dtype == np.int32
        assert (t.array == -1).all()
        s.array[1, 2] = 5
        assert t.array[1, 2] == 5
        assert t.add((1, 2), 3) == 5 and s.array[1, 2] == 8
        with pytest.raises(IndexError):
            s.add(6)
        f = Signal.create(reg, "floats", 2, dtype=np.float64)
        with pytest.raises(IpcError):
            f.add(0)
        for x in (s, t, f):
            x.close()


@pytest.mark.e2e
def test_atomic_add_across_processes(node):
    with Registry.create(node) as reg:
        s = Signal.create(reg, "counters", (2, 2), dtype=np.int64)
        procs = [spawn_py(ADD, node) for _ in range(4)]
        for p in procs:
            assert p.wait(60) == 0, p.stderr.read()
        assert s.array[0, 0] == 80000 and s.array[1, 1] == 160000
        s.close()
