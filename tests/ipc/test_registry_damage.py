"""A damaged registry must not brick a node name: readers skip damaged slots, reclaiming
removes every object that carries the node's name, and nothing of a live node is ever
removed, whatever was written over its registry (liveness comes from the owner's flock)."""
import os
import signal
import struct
import subprocess
import sys

import pytest

from kvrt.ipc.errors import NodeLive
from kvrt.ipc.registry import HEADER, SLOT, Registry, reclaim
from kvrt.ipc.shm import Segment, object_name, segment_exists
from tests.conftest import REPO, leftovers, spawn_py
from tests.ipc.test_registry import OWNER


def _damage_slot(node: str, slot: int, data: bytes = b"\xc1\xc1garbage") -> None:
    seg = Segment.attach(object_name(node, "registry"))
    off = HEADER + slot * SLOT
    struct.pack_into("<I", seg.mm, off, len(data))
    seg.mm[off + 4: off + 4 + len(data)] = data
    seg.close()


def _owner(node: str) -> subprocess.Popen:
    p = spawn_py(OWNER, node)
    assert p.stdout.readline().strip() == "ready"
    return p


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_damaged_slots_are_skipped_and_listed(node):
    with Registry.create(node) as reg:
        for i in range(4):
            reg.create_segment(f"s{i}", 4096).close()
        _damage_slot(node, 1)
        _damage_slot(node, 2, struct.pack("<I", 0) * 3)
        reader = Registry.attach(node)
        names = [e.name for e in reader.entries()]
        assert names == [object_name(node, "s0"), object_name(node, "s3")] and reader.damaged == [1, 2]
        reader.close()
    assert not leftovers(node)  # the owner's unlink also removed the objects of damaged slots


def test_a_slot_naming_another_nodes_object_is_not_trusted(node):
    import msgpack
    victim = Segment.create(object_name(node + "v", "precious"), 4096)
    try:
        with Registry.create(node) as reg:
            reg.create_segment("mine", 4096).close()
            forged = msgpack.packb({"name": victim.name, "kind": "segment", "dtype": "", "shape": [],
                                    "creator_pid": 1, "created": 0.0, "meta": {}})
            _damage_slot(node, 0, forged)
            assert all(e.name != victim.name for e in Registry.attach(node).entries())
        assert segment_exists(victim.name)
    finally:
        victim.unlink()
        victim.close()


@pytest.mark.e2e
def test_dead_node_with_a_damaged_slot_is_reclaimed_completely_and_relaunchable(node):
    p = _owner(node)
    _kill(p)
    _damage_slot(node, 1)  # the pool's entry
    removed = reclaim(node)
    assert object_name(node, "pool") in removed and object_name(node, "registry") in removed
    assert not leftovers(node)
    p = _owner(node)  # and a new owner over fresh damage reclaims by itself
    _kill(p)
    _damage_slot(node, 0)
    with Registry.create(node) as reg:
        assert reg.entries() == []
        assert not [n for n in leftovers(node) if not n.endswith(".registry")]


@pytest.mark.e2e
def test_live_node_with_a_damaged_header_is_never_reclaimed(node):
    p = _owner(node)
    try:
        before = sorted(leftovers(node))
        seg = Segment.attach(object_name(node, "registry"))
        seg.mm[0:HEADER] = b"\0" * HEADER  # magic, owner pid and start time all gone
        seg.close()
        old = 1_000_000_000.0  # and as if it started long ago
        os.utime(os.path.join("/dev/shm", object_name(node, "registry")), (old, old))
        with pytest.raises(NodeLive):
            reclaim(node)
        with pytest.raises(NodeLive):
            Registry.create(node)
        assert sorted(leftovers(node)) == before
    finally:
        _kill(p)
        reclaim(node)


@pytest.mark.e2e
def test_live_node_whose_owner_pid_was_overwritten_is_never_reclaimed(node):
    p = _owner(node)
    try:
        before = sorted(leftovers(node))
        seg = Segment.attach(object_name(node, "registry"))
        struct.pack_into("<Q", seg.mm, 16, 0x7FFFFFF0)  # a pid that does not exist
        seg.close()
        with pytest.raises(NodeLive):
            reclaim(node)
        out = subprocess.run([sys.executable, "-m", "kvrt.launcher", "clean", "--node", node], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "refusing" in out.stdout, out
        assert sorted(leftovers(node)) == before
    finally:
        _kill(p)
        reclaim(node)
    assert not leftovers(node)
