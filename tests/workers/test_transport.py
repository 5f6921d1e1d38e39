"""P->D block transports (workers/transports/): real pools in shared memory, real processes,
real Mooncake engines on loopback; no mocks.

Every write is checked block by block: each destination block holds exactly its source's
bytes, every other destination block is unchanged, and a refused order writes nothing."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

import msgpack
import numpy as np
import pytest
import xxhash

from kvrt.ipc import protocol
from kvrt.ipc.registry import Registry, reclaim
from tests.conftest import REPO, leftovers, run_py
from kvrt.workers.backend import NumpyBackend, Pool, create_shm_pool
from kvrt.workers.kv_pool import coalesce
from kvrt.workers.transports.base import TRANSPORTS, Endpoint, TransferError
from kvrt.workers.transports.factory import open_transport
from kvrt.workers.transports.mooncake import unavailable_reason

BLOCK = (2, 2, 4, 2, 16)  # layers, K/V, tokens, heads, head_dim: 1 KiB of float16
BLOCK_BYTES = int(np.prod(BLOCK)) * 2
MOONCAKE_MISSING = unavailable_reason()
needs_mooncake = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=f"mooncake: {MOONCAKE_MISSING}")


# ---- helpers ------------------------------------------------------------------------------

@pytest.fixture
def names():
    """Fresh node names (call it for each); the test fails if any object of them outlives it."""
    made: list[str] = []

    def new() -> str:
        made.append("t" + uuid.uuid4().hex[:10])
        return made[-1]

    yield new
    left = [n for name in made for n in leftovers(name)]
    assert not left, f"shared-memory objects leaked: {left}"


@contextmanager
def node_pool(node: str, blocks: int, block=BLOCK, dtype="float16", seed: int | None = None):
    """A node registry owning one rank-0 device pool in /dev/shm, mapped here; unlinked after."""
    with Registry.create(node) as reg:
        create_shm_pool(reg, protocol.device_pool(0), (blocks, *block), dtype,
                        {"backend": "numpy", "tier": "device", "rank": 0})
        pool = NumpyBackend().open_device_pool(reg, protocol.device_pool(0))
        try:
            if seed is not None:
                fill(pool, seed)
            yield reg, pool
        finally:
            pool.close()


def plain_pool(blocks: int, seed: int) -> Pool:
    """A pool that is just a numpy array in this process (Mooncake needs only its address)."""
    pool = Pool("plain", np.zeros((blocks, *BLOCK), np.float16), NumpyBackend(), True, lambda: None)
    fill(pool, seed)
    return pool


def fill(pool: Pool, seed: int) -> None:
    flat = pool.array.reshape(-1).view(np.uint8)
    flat[:] = np.random.default_rng(seed).integers(0, 256, flat.size, dtype=np.uint8)


def sums(pool: Pool) -> list[int]:
    return [xxhash.xxh3_64_intdigest(pool.array[b].tobytes()) for b in range(pool.num_blocks)]


def random_order(rng: np.random.Generator, n_src: int, n_dst: int, runs: int) -> tuple[np.ndarray, np.ndarray]:
    """Random (src, dst) pairs made of runs of 1-6 consecutive blocks on both sides, each
    destination block at most once, runs in random order."""
    src: list[int] = []
    dst: list[int] = []
    used: set[int] = set()
    while runs:
        k = int(rng.integers(1, 7))
        s, d = int(rng.integers(0, n_src - k + 1)), int(rng.integers(0, n_dst - k + 1))
        if used.intersection(range(d, d + k)):
            continue
        used.update(range(d, d + k))
        src += range(s, s + k)
        dst += range(d, d + k)
        runs -= 1
    return np.array(src), np.array(dst)


def check_written(before: list[int], after: list[int], src_sums: list[int], src, dst) -> None:
    """Each destination block holds its source's bytes; every other block is unchanged."""
    for s, d in zip(np.asarray(src).tolist(), np.asarray(dst).tolist()):
        assert after[d] == src_sums[s], f"block {s} -> {d} wrong"
    written = set(np.asarray(dst).tolist())
    for b, (x, y) in enumerate(zip(before, after)):
        if b not in written:
            assert x == y, f"untouched block {b} changed"


def start_py(code: str, *args: str, stderr=None) -> subprocess.Popen:
    """A long-lived helper process we talk to over stdin/stdout (closing stdin ends it)."""
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr or subprocess.DEVNULL, text=True)


def read_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, f"helper process exited with {proc.wait(10)}"
    return line


def stop(proc: subprocess.Popen) -> int:
    if proc.stdin:
        proc.stdin.close()
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


# ---- the interface ------------------------------------------------------------------------

def test_factory_descriptor_and_closed_transport(names):
    d = names()
    with node_pool(d, 8) as (_, pool):
        with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
            open_transport("carrier-pigeon", pool, Endpoint(d))
        assert TRANSPORTS == ("shm", "mooncake")
        tr = open_transport("shm", pool, Endpoint(d, 0))
        desc = tr.descriptor()
        assert msgpack.unpackb(msgpack.packb(desc)) == desc  # carried by msgpack between engines
        assert desc["transport"] == "shm" and desc["node"] == d and desc["rank"] == 0
        assert (desc["num_blocks"], desc["block_shape"], desc["dtype"], desc["block_bytes"]) == \
            (8, list(BLOCK), "<f2", BLOCK_BYTES)
        tr.close()
        tr.close()  # idempotent
        with pytest.raises(TransferError, match="closed"):
            tr.write_blocks(desc, [0], [1])


# ---- shm ----------------------------------------------------------------------------------

def test_shm_writes_random_runs_and_nothing_else(names):
    p, d = names(), names()
    rng = np.random.default_rng(7)
    with node_pool(p, 64, seed=1) as (_, src_pool), node_pool(d, 48, seed=2) as (_, dst_pool):
        rx = open_transport("shm", dst_pool, Endpoint(d, 0))
        with open_transport("shm", src_pool, Endpoint(p, 0)) as tx:
            src_sums = sums(src_pool)
            for _ in range(3):
                src, dst = random_order(rng, 64, 48, 6)
                assert len(coalesce(src, dst)) < len(src)  # there are multi-block runs
                before = sums(dst_pool)
                assert tx.write_blocks(rx.descriptor(), src, dst) == len(src) * BLOCK_BYTES
                check_written(before, sums(dst_pool), src_sums, src, dst)
            assert tx.write_blocks(rx.descriptor(), [], []) == 0
            # the transport maps D's pool once and keeps it
            assert list(tx._peers) == [(d, 0)]
        assert tx._peers == {} and tx.closed
        rx.close()


SHM_SENDER = """
import json, sys
import numpy as np
from kvrt.ipc import protocol
from kvrt.ipc.registry import Registry
from kvrt.workers.backend import NumpyBackend
from kvrt.workers.transports.base import Endpoint, TransferError
from kvrt.workers.transports.factory import open_transport
p_node, desc, src, dst = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
reg = Registry.attach(p_node)
pool = NumpyBackend().open_device_pool(reg, protocol.device_pool(0))
with open_transport("shm", pool, Endpoint(p_node, 0)) as tx:
    print(tx.write_blocks(desc, np.array(src), np.array(dst)))
    try:
        tx.write_blocks(desc, [0], [desc["num_blocks"]])
    except TransferError as e:
        print("refused:", e)
pool.close(); reg.close()
"""


@pytest.mark.e2e
def test_shm_sender_in_its_own_process(names):
    """The cache-messager's view: another process maps P's pool and writes into D's."""
    p, d = names(), names()
    src, dst = random_order(np.random.default_rng(3), 64, 48, 8)
    with node_pool(p, 64, seed=3) as (_, src_pool), node_pool(d, 48, seed=4) as (_, dst_pool):
        desc = open_transport("shm", dst_pool, Endpoint(d, 0)).descriptor()
        before = sums(dst_pool)
        r = run_py(SHM_SENDER, p, json.dumps(desc), json.dumps(src.tolist()), json.dumps(dst.tolist()))
        assert r.returncode == 0, r.stderr
        out = r.stdout.splitlines()
        assert out[0] == str(len(src) * BLOCK_BYTES)
        assert out[1].startswith("refused:") and "destination block id 48 out of range 0..47" in out[1] \
            and f"node {d} rank 0" in out[1]
        check_written(before, sums(dst_pool), sums(src_pool), src, dst)


def test_shm_bad_orders_are_refused_before_anything_is_written(names):
    p, d = names(), names()
    with node_pool(p, 16, seed=5) as (_, src_pool), node_pool(d, 8, seed=6) as (_, dst_pool):
        desc = open_transport("shm", dst_pool, Endpoint(d, 0)).descriptor()
        before = sums(dst_pool)
        with open_transport("shm", src_pool, Endpoint(p, 0)) as tx:
            cases = [
                (([1, 2], [3, 8]), r"destination block id 8 out of range 0\.\.7"),
                (([1, 16], [3, 4]), r"source block id 16 out of range 0\.\.15"),
                (([-1], [3]), r"source block id -1 out of range"),
                (([1, 2, 3], [4, 5]), "3 source blocks paired with 2 destination blocks"),
                (([1, 2], [4, 4]), "destination block 4 is written more than once"),
                (([1.0], [2.0]), "must be integers"),
                (([[1]], [[2]]), "must be a flat list"),
            ]
            for (src, dst), msg in cases:
                with pytest.raises(TransferError, match=msg) as e:
                    tx.write_blocks(desc, src, dst)
                assert f"node {d} rank 0" in str(e.value)
            with pytest.raises(TransferError, match="not 'shm'"):
                tx.write_blocks({"transport": "mooncake", "node": d}, [0], [0])
            with pytest.raises(TransferError, match="lacks rank"):
                tx.write_blocks({"transport": "shm", "node": d}, [0], [0])
            with pytest.raises(TransferError, match="another machine"):
                tx.write_blocks({**desc, "machine": "some-other-boot-id"}, [0], [0])
            with pytest.raises(TransferError, match="stale: it says 9 blocks"):
                tx.write_blocks({**desc, "num_blocks": 9}, [0], [0])
            with pytest.raises(TransferError, match="no device pool for rank 3"):
                tx.write_blocks({**desc, "rank": 3}, [0], [0])
        assert sums(dst_pool) == before


def test_shm_pools_that_do_not_match_are_named(names):
    p, d = names(), names()
    other = BLOCK[:-1] + (8,)
    with node_pool(p, 8, seed=1) as (_, src_pool), node_pool(d, 8, block=other) as (_, dst_pool):
        desc = open_transport("shm", dst_pool, Endpoint(d, 0)).descriptor()
        with open_transport("shm", src_pool, Endpoint(p, 0)) as tx:
            with pytest.raises(TransferError) as e:
                tx.write_blocks(desc, [0], [0])
        msg = str(e.value)
        assert "block layouts differ" in msg and f"node {p} rank 0" in msg and f"node {d} rank 0" in msg
        assert "[2x2x4x2x16] float16" in msg and "[2x2x4x2x8] float16" in msg


D_OWNER = """
import sys
from kvrt.ipc import protocol
from kvrt.ipc.registry import Registry
from kvrt.workers.backend import create_shm_pool
reg = Registry.create(sys.argv[1])
create_shm_pool(reg, protocol.device_pool(0), (8, 2, 2, 4, 2, 16), "float16", {"backend": "numpy", "rank": 0})
print("ready", flush=True)
sys.stdin.read()
reg.unlink_all()
"""


@pytest.mark.e2e
def test_shm_peer_that_vanished_is_an_error_not_a_crash(names):
    p, d, gone, killed = names(), names(), names(), names()
    with node_pool(p, 8, seed=1) as (_, src_pool):
        tx = open_transport("shm", src_pool, Endpoint(p, 0))
        # a node that never existed
        with pytest.raises(TransferError, match=f"cannot reach peer node {gone} rank 0"):
            tx.write_blocks({"transport": "shm", "node": gone, "rank": 0}, [0], [0])
        # a node that stopped (its launcher unlinked everything) after a first write
        with node_pool(d, 8) as (_, dst_pool):
            desc = open_transport("shm", dst_pool, Endpoint(d, 0)).descriptor()
            assert tx.write_blocks(desc, [1], [2]) == BLOCK_BYTES
        with pytest.raises(TransferError, match=f"peer node {d} rank 0 is gone: its registry was removed"):
            tx.write_blocks(desc, [1], [2])
        with pytest.raises(TransferError, match=f"cannot reach peer node {d}"):
            tx.write_blocks(desc, [1], [2])
        # a node whose launcher was SIGKILLed: its segments stay until `kvrt clean`
        owner = start_py(D_OWNER, killed)
        try:
            assert read_line(owner) == "ready\n"
            desc = {"transport": "shm", "node": killed, "rank": 0}
            assert tx.write_blocks(desc, [3], [4]) == BLOCK_BYTES
            owner.kill()
            owner.wait()
            with pytest.raises(TransferError, match=rf"is gone: its launcher \(pid {owner.pid}\) exited"):
                tx.write_blocks(desc, [3], [4])
            with pytest.raises(TransferError, match=rf"launcher \(pid {owner.pid}\) is dead"):
                tx.write_blocks(desc, [3], [4])
        finally:
            if owner.poll() is None:
                owner.kill()
                owner.wait()
            reclaim(killed)
        assert tx._peers == {}
        tx.close()


# ---- mooncake -----------------------------------------------------------------------------

MC_RECEIVER = """
import json, sys
from kvrt.ipc import protocol
from kvrt.ipc.registry import Registry
from kvrt.workers.backend import NumpyBackend
from kvrt.workers.transports.base import Endpoint
from kvrt.workers.transports.factory import open_transport
reg = Registry.attach(sys.argv[1])
pool = NumpyBackend().open_device_pool(reg, protocol.device_pool(0))
rx = open_transport("mooncake", pool, Endpoint(sys.argv[1], 0, host="127.0.0.1"))
print(json.dumps(rx.descriptor()), flush=True)
sys.stdin.read()
rx.close(); pool.close(); reg.close()
print("closed", flush=True)
"""


@pytest.mark.alone
@pytest.mark.e2e
@needs_mooncake
def test_mooncake_loopback_between_two_processes(names, tmp_path):
    """D's engine in its own process over D's pool in shared memory; P's engine here over a
    plain array; random runs checked in D's pool; then D dies and the next write fails fast."""
    d = names()
    rng = np.random.default_rng(11)
    src_pool = plain_pool(64, seed=12)
    src_sums = sums(src_pool)
    with node_pool(d, 48, seed=13) as (_, dst_pool):
        err = open(tmp_path / "receiver.err", "w")
        rx = start_py(MC_RECEIVER, d, stderr=err)
        try:
            desc = json.loads(read_line(rx))
            assert msgpack.unpackb(msgpack.packb(desc)) == desc
            assert desc["transport"] == "mooncake" and desc["session"].startswith("127.0.0.1:")
            assert desc["nbytes"] == 48 * BLOCK_BYTES and desc["protocol"] == "tcp"
            tx = open_transport("mooncake", src_pool, Endpoint("p", 0), timeout_s=5, connect_timeout_s=2)
            for _ in range(3):
                src, dst = random_order(rng, 64, 48, 6)
                assert len(coalesce(src, dst)) < len(src)
                before = sums(dst_pool)
                assert tx.write_blocks(desc, src, dst) == len(src) * BLOCK_BYTES
                check_written(before, sums(dst_pool), src_sums, src, dst)
            assert tx.write_blocks(desc, [], []) == 0
            rx.send_signal(signal.SIGKILL)
            rx.wait()
            t0 = time.monotonic()
            with pytest.raises(TransferError, match=f"to node {d} rank 0 at {desc['session']}"):
                tx.write_blocks(desc, [1, 2], [3, 4])
            assert time.monotonic() - t0 < 7
            tx.close()
        finally:
            if rx.poll() is None:
                assert stop(rx) == 0, (tmp_path / "receiver.err").read_text()
            err.close()


@pytest.mark.e2e
@needs_mooncake
def test_mooncake_receiver_closes_cleanly(names):
    d = names()
    with node_pool(d, 8):
        rx = start_py(MC_RECEIVER, d)
        json.loads(read_line(rx))
        rx.stdin.close()
        assert read_line(rx) == "closed\n"
        assert rx.wait(20) == 0


@needs_mooncake
def test_mooncake_errors_are_bounded_and_named():
    """Both engines in this process (the library allows it). Every failure is a TransferError
    naming the peer, within a bounded time; refused orders write nothing."""
    src_pool, dst_pool = plain_pool(16, seed=21), plain_pool(8, seed=22)
    rx = open_transport("mooncake", dst_pool, Endpoint("d", 0))
    tx = open_transport("mooncake", src_pool, Endpoint("p", 0), timeout_s=5, connect_timeout_s=1)
    listener = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    try:
        desc = rx.descriptor()
        before = sums(dst_pool)
        assert tx.write_blocks(desc, [0, 1, 2, 9], [5, 6, 7, 0]) == 4 * BLOCK_BYTES
        check_written(before, sums(dst_pool), sums(src_pool), [0, 1, 2, 9], [5, 6, 7, 0])
        before = sums(dst_pool)
        with pytest.raises(TransferError, match=r"destination block id 8 out of range 0\.\.7"):
            tx.write_blocks(desc, [0, 1], [7, 8])
        with pytest.raises(TransferError, match="not 'mooncake'"):
            tx.write_blocks({**desc, "transport": "shm"}, [0], [0])
        with pytest.raises(TransferError, match="lacks base"):
            tx.write_blocks({k: v for k, v in desc.items() if k != "base"}, [0], [0])
        with pytest.raises(TransferError, match="speaks rdma"):
            tx.write_blocks({**desc, "protocol": "rdma"}, [0], [0])
        with pytest.raises(TransferError, match=r"block layouts differ: node p rank 0 .* node d rank 0 at"):
            tx.write_blocks({**desc, "block_shape": [2, 2, 4, 2, 8], "block_bytes": BLOCK_BYTES // 2}, [0], [0])
        with pytest.raises(TransferError, match="do not fit"):
            tx.write_blocks({**desc, "num_blocks": 9}, [0], [8])
        # a descriptor pointing past D's registered pool: D's engine refuses the write
        with pytest.raises(TransferError, match=r"1 of 1 runs failed .*accepts connections"):
            tx.write_blocks({**desc, "base": desc["base"] + desc["nbytes"]}, [0], [0])
        assert sums(dst_pool) == before
        # a port where nothing listens
        host, port = "127.0.0.1", listener.getsockname()[1]
        with socket.socket() as s:
            s.bind((host, 0))
            dead = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=f"handshake with node d rank 0 at {host}:{dead} failed .*"
                                                "nothing answers"):
            tx.write_blocks({**desc, "session": f"{host}:{dead}"}, [0], [0])
        assert time.monotonic() - t0 < 3
        # a port that accepts but never answers (a stopped peer): bounded by connect_timeout_s
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="got no answer within 1s"):
            tx.write_blocks({**desc, "session": f"{host}:{port}"}, [0], [0])
        assert time.monotonic() - t0 < 3
        # the good peer still works after all that
        assert tx.write_blocks(desc, [3], [3]) == BLOCK_BYTES
        assert sums(dst_pool)[3] == sums(src_pool)[3]
    finally:
        listener.close()  # ends the handshake still waiting on it
        tx.close()
        rx.close()
    from kvrt.workers.transports.mooncake import _PARKED
    assert _PARKED == []  # nothing was left inside the engines
    with pytest.raises(ValueError, match="protocol 'udp'"):
        open_transport("mooncake", src_pool, Endpoint("p"), protocol="udp")


@needs_mooncake
def test_mooncake_write_of_more_runs_than_fit_in_flight():
    """Scattered ids make one run per block; more runs than the in-flight window (and than
    Mooncake's per-peer queue, where unwindowed runs were never confirmed) all land."""
    from kvrt.workers.transports.mooncake import _WINDOW

    src_pool, dst_pool = plain_pool(2048, seed=31), plain_pool(2048, seed=32)
    rng = np.random.default_rng(33)
    with open_transport("mooncake", dst_pool, Endpoint("d", 0)) as rx, \
            open_transport("mooncake", src_pool, Endpoint("p", 0), timeout_s=10) as tx:
        src, dst = rng.choice(2048, 1500, replace=False), rng.choice(2048, 1500, replace=False)
        assert len(coalesce(src, dst)) > 4 * _WINDOW
        before = sums(dst_pool)
        assert tx.write_blocks(rx.descriptor(), src, dst) == 1500 * BLOCK_BYTES
        check_written(before, sums(dst_pool), sums(src_pool), src, dst)


@pytest.mark.e2e
def test_mooncake_missing_library_says_what_to_install():
    """Where the engine cannot import (package or libibverbs missing) the error names both."""
    code = """
import sys
sys.modules["mooncake"] = None  # as if the package were not installed
import numpy as np
from kvrt.workers.backend import NumpyBackend, Pool
from kvrt.workers.transports.base import Endpoint, TransportUnavailable
from kvrt.workers.transports.factory import open_transport
pool = Pool("p", np.zeros((2, 4)), NumpyBackend(), True, lambda: None)
try:
    open_transport("mooncake", pool, Endpoint("p"))
except ImportError as e:
    print(type(e).__name__, isinstance(e, TransportUnavailable), e)
"""
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("TransportUnavailable True")
    assert 'pip install -e ".[pd]"' in r.stdout and "apt-get install libibverbs1" in r.stdout


def test_shm_first_write_after_the_peer_restarted_maps_it_again(names):
    """A D node that stopped and started again (same name, new registry) is written into on
    the first try with its new descriptor; a descriptor of its earlier run is refused (its
    block ids mean nothing now), and so is an order past its deadline, before any byte moves."""
    import time

    p, d = names(), names()
    with node_pool(p, 8, seed=1) as (_, src_pool):
        with open_transport("shm", src_pool, Endpoint(p, 0)) as tx:
            with node_pool(d, 8) as (reg, dst_pool):
                desc = open_transport("shm", dst_pool, Endpoint(d, 0)).descriptor()
                assert tx.write_blocks(desc, [1], [2]) == BLOCK_BYTES
            with node_pool(d, 8) as (reg, dst_pool):  # the restart
                instance = f"{reg.owner_pid}:{reg.owner_start_ms}"
                new = open_transport("shm", dst_pool, Endpoint(d, 0, instance=instance)).descriptor()
                assert tx.write_blocks(new, [1, 3], [2, 5]) == 2 * BLOCK_BYTES
                assert [sums(dst_pool)[b] for b in (2, 5)] == [sums(src_pool)[b] for b in (1, 3)]
                with pytest.raises(TransferError, match="from another run of that node"):
                    tx.write_blocks({**new, "instance": "1:1"}, [4], [6])
                with pytest.raises(TransferError, match="expired"):
                    tx.write_blocks(new, [4], [6], deadline=time.monotonic() - 1)
                assert not dst_pool.array[6].any()


@needs_mooncake
def test_mooncake_reports_listeners_wider_than_the_configured_host():
    """The node's --host is handed to the engine; a Mooncake build that listens on every
    interface anyway is reported (the log names the ports to firewall), never silent."""
    pool = plain_pool(4, seed=1)
    with open_transport("mooncake", pool, Endpoint("d", 0, host="127.0.0.1")) as rx:
        wide = rx.wide_open
        assert all(not addr.startswith("127.0.0.1:") for addr in wide)
        assert any(addr.endswith(f":{rx.port}") for addr in wide) or not wide
