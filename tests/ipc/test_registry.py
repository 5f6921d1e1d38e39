import os
import signal
import stat

import pytest

from kvrt.ipc.errors import IpcError, NodeLive
from kvrt.ipc.registry import Registry, list_nodes, reclaim
from kvrt.ipc.ring import Ring
from kvrt.ipc.shm import object_name, segment_exists, validate_node_name
from tests.conftest import leftovers, run_py, spawn_py


def test_create_register_attach_and_unlink(node):
    with Registry.create(node) as reg:
        seg = reg.create_segment("pool.0", 8192, kind="pool", dtype="<f2", shape=(2, 4096), meta={"rank": 0})
        seg.close()
        Ring.create(reg, "ring.a", capacity=4096)
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{object_name(node, 'pool.0')}").st_mode)
        assert mode == 0o600
        reader = Registry.attach(node)
        names = [e.name for e in reader.entries()]
        assert object_name(node, "pool.0") in names and object_name(node, "ring.a") in names
        info = reader.find("pool.0")
        assert (info.kind, info.dtype, info.shape, info.meta, info.creator_pid) == \
            ("pool", "<f2", (2, 4096), {"rank": 0}, os.getpid())
        assert reader.owner_pid == os.getpid() and reader.owner_alive()
        assert node in list_nodes()
        with pytest.raises(IpcError):
            reader.add(info)  # readers never write
        with pytest.raises(IpcError):
            reader.find("nope")
        reader.close()
    assert not leftovers(node)
    assert node not in list_nodes()


def test_live_node_is_not_clobbered(node):
    with Registry.create(node) as reg:
        reg.create_segment("x", 4096).close()
        with pytest.raises(NodeLive):
            Registry.create(node)
        with pytest.raises(NodeLive):
            reclaim(node)
        assert segment_exists(object_name(node, "x"))


OWNER = """
import sys, time
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Ring
from kvrt.ipc.signals import Signal
reg = Registry.create(sys.argv[1])
reg.create_segment("pool", 1 << 16).close()
Ring.create(reg, "ring", capacity=4096)
Signal.create(reg, "ready", 4)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.e2e
def test_dead_owner_is_reclaimed_and_name_reusable(node):
    p = spawn_py(OWNER, node)
    assert p.stdout.readline().strip() == "ready"
    assert len(leftovers(node)) >= 5  # registry, pool, ring + 2 doorbells, signal
    with pytest.raises(NodeLive):
        reclaim(node)
    p.send_signal(signal.SIGKILL)
    p.wait()
    dry = reclaim(node, dry_run=True)
    assert object_name(node, "pool") in dry and leftovers(node)
    removed = reclaim(node)
    assert object_name(node, "registry") in removed
    assert not leftovers(node)
    # the name is free again; a new owner over leftovers also reclaims by itself
    p = spawn_py(OWNER, node)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGKILL)
    p.wait()
    with Registry.create(node) as reg:
        assert reg.entries() == []


ATTACH_AND_EXIT = """
import sys
from kvrt.ipc.registry import Registry
from kvrt.ipc.signals import Signal
reg = Registry.attach(sys.argv[1])
s = Signal.attach(reg, "flags")
s.array[1] = 7
"""


@pytest.mark.e2e
def test_attaching_process_exit_does_not_unlink(node):
    from kvrt.ipc.signals import Signal
    with Registry.create(node) as reg:
        sig = Signal.create(reg, "flags", 4, dtype="int32")
        r = run_py(ATTACH_AND_EXIT, node)
        assert r.returncode == 0, r.stderr
        assert sig.array[1] == 7
        assert segment_exists(sig.name)  # no resource tracker unlinked it
        sig.close()


@pytest.mark.parametrize("bad", ["", "a.b", "a/b", "x" * 65, "sp ace"])
def test_bad_node_names(bad):
    with pytest.raises(ValueError):
        validate_node_name(bad)
