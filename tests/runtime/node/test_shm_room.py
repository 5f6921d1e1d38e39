"""Every segment is allocated in full when it is created, and the launcher's /dev/shm room
check counts everything it will create (rings and signals too, not only the KV pools): a full
/dev/shm fails the launch with a message naming the sizes, never a SIGBUS in a ring later."""
import os
import shutil
import subprocess
import sys

import pytest

from kvrt.ipc.ports import free_port

from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import HEADER, Ring
from kvrt.ipc.shm import object_name
from kvrt.runtime.node.config import NodeConfig
from tests.conftest import REPO


def allocated_bytes(name: str) -> int:
    """Bytes of /dev/shm backing a segment (a sparse one has fewer than its size)."""
    return os.stat(os.path.join("/dev/shm", name)).st_blocks * 512


def test_rings_signals_and_the_registry_are_allocated_at_creation(node):
    from kvrt.ipc.signals import Signal

    with Registry.create(node) as reg:
        Ring.create(reg, "r", capacity=1 << 16)
        sig = Signal.create(reg, "s", 3000)
        for obj, size in (("r", HEADER + (1 << 16)), ("s", 3000 * 8), ("registry", 1)):
            assert allocated_bytes(object_name(node, obj)) >= size, obj
        sig.close()


def test_the_room_check_counts_rings_and_signals():
    from kvrt.runtime.node.supervisor import RING_BYTES, shm_needs

    cfg = NodeConfig(node="x", tp=2, num_cpu_blocks=4, role="mixed")
    needs = shm_needs(cfg, pool_bytes=1000)
    assert needs["KV pools"] == 1000
    assert needs["rings"] >= 2 * 4 * RING_BYTES  # per rank: to and from worker and cache-transfer
    assert needs["signals"] > 0


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for a private tmpfs")
def test_launch_on_a_small_dev_shm_fails_naming_the_sizes(node):
    # a private mount namespace with a 2 MiB /dev/shm: the tiny pool fits, its two 1 MiB rings do not
    launch = (f"{sys.executable} -m kvrt.launcher launch --node {node} --num-layers 2 --num-kv-heads 2 "
              f"--head-dim 16 --block-size 8 --num-gpu-blocks 16 --port {free_port()}")
    script = f"mount -t tmpfs -o size=2m,mode=1777 tmpfs /dev/shm && exec {launch}"
    try:
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the launch did not fail: {e.stderr}") from None
    if "mount" in r.stderr and "permission denied" in r.stderr.lower():
        pytest.skip("cannot mount a tmpfs here")
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "/dev/shm has" in last and "rings 2.0 MiB" in last and "KV pools" in last, r.stderr
