"""The Mooncake Store tier with a real master and real store clients on 127.0.0.1: `kvrt store
start` (a master plus the memory it lends), the backend's batched zero-copy reads and writes,
two nodes sharing one pool, and a master that dies while a node serves (misses, never errors)."""
from __future__ import annotations

import ctypes.util
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvrt.ipc.storage_uri import parse_storage
from tests.conftest import REPO
from kvrt.ipc.ports import free_port
from tests.launched import SMALL, launched, oracle, pd_secret_file, shared_prefix_prompts

pytestmark = pytest.mark.e2e

mooncake = pytest.importorskip("mooncake.store", reason="the Mooncake Store client (mooncake-transfer-engine) "
                               "is not installed")
if ctypes.util.find_library("ibverbs") is None:
    pytest.skip("libibverbs is missing (the Mooncake wheel needs it even for TCP): apt-get install libibverbs1",
                allow_module_level=True)

from kvrt.workers.storage.base import StorageError  # noqa: E402  (after the skips)
from kvrt.workers.storage.mooncake import ASK_LIMIT_S, RETRY_S, MooncakeStorage, open_client  # noqa: E402
from kvrt.workers.storage.mooncake_probe import probe_master  # noqa: E402

NEW = 4


class Store:
    """`kvrt store start` in a subprocess: the master's port and pid, the flags of a node on it
    (with a storage secret made in `secret_dir`), and a clean stop."""

    def __init__(self, secret_dir, memory: str = "128M", port: int = 0):
        self.port = port or free_port()
        self.metrics_port = free_port()  # the master's HTTP admin server (it lists every object)
        self.stderr = os.path.join(str(secret_dir), f"store-{self.port}.stderr")
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "store", "start", "--port",
                                          str(self.port), "--memory", memory, "--metrics-port", str(self.metrics_port)],
                                         cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline()  # the ready line, or "" when it exited first
        if "mooncake master on" not in line:
            self.stop()
            raise AssertionError(f"kvrt store start did not come up (exit {self.proc.returncode}): {line!r}")
        self.master_pid = int(line.split("(pid ")[1].split(")")[0])
        self.uri = f"mooncake://127.0.0.1:{self.port}"
        self.secret = pd_secret_file(secret_dir, "store")  # the node group's
        self.node_opts = ("--storage", self.uri, "--storage-secret-file", self.secret)

    def kill_master(self) -> None:
        os.kill(self.master_pid, signal.SIGKILL)

    def freeze_master(self) -> None:
        """A master that keeps its port (connections are still accepted) and answers nothing."""
        os.kill(self.master_pid, signal.SIGSTOP)

    def stop(self) -> None:
        """The store and its master killed: a test's store is gone at once, where a clean stop
        waits for the master's own exit (about 0.9 s). The clean stop has tests of its own
        (test_a_stopped_store_stops_its_master); a kill leaves nothing in /dev/shm."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(20)
        try:  # never leave a master behind, whatever happened to its parent
            os.kill(self.master_pid, signal.SIGKILL)
        except (ProcessLookupError, AttributeError):
            pass


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 2, 2, 8, 16)).astype(np.float32)


def test_batched_zero_copy_round_trip_and_misses(store):
    spec = parse_storage(store.uri)
    a, b = MooncakeStorage(spec, rank=0), MooncakeStorage(spec, rank=0)
    try:
        src, dst = blocks(8, 1), np.zeros((8, 2, 2, 8, 16), np.float32)
        a.register(src)
        b.register(dst)
        keys = [bytes([i]) * 16 for i in range(8)]
        assert a.put_many(keys[:6], list(src[:6])) == 6 * src[0].nbytes
        assert b.exists_many(keys) == 6
        assert b.get_many(keys, list(dst)) == 6  # the first missing key ends the prefix
        assert np.array_equal(dst[:6], src[:6]) and not dst[6:].any()
        dst[:] = 0
        assert b.get_many(keys, list(dst), deadline=time.monotonic() - 1) == 0 and not dst.any(), \
            "nothing is written for a task past its deadline"
        loose = np.zeros((2, 2, 8, 16), np.float32)  # not in a registered pool: staged, same answer
        assert b.get(keys[2], loose) and np.array_equal(loose, src[2])
        other_rank = MooncakeStorage(spec, rank=1)
        assert other_rank.exists_many(keys) == 0, "each rank has its own objects"
        other_rank.close()
        assert a.errors == b.errors == 0
    finally:
        a.close()
        b.close()


@pytest.mark.alone
def test_a_dead_master_means_misses_not_errors(store):
    s = MooncakeStorage(parse_storage(store.uri), rank=0, retry_s=60.0)
    try:
        data = blocks(2, 2)
        s.register(data)
        keys = [b"\x01" * 16, b"\x02" * 16]
        s.put_many(keys, list(data))
        store.kill_master()
        out = np.zeros_like(data)
        assert s.get_many(keys, list(out)) == 0  # the first failure marks the store down
        assert s.errors >= 1
        t0 = time.monotonic()
        assert s.get_many(keys, list(out)) == 0 and s.put_many(keys, list(data)) == 0
        assert not s.contains(keys[0])
        assert time.monotonic() - t0 < 1.0, "calls while the store is down must not wait for the master"
    finally:
        s.close()


def test_a_frozen_master_costs_one_short_wait_not_one_per_call(store):
    """A frozen master's port still accepts and its client's calls wait out their own RPC
    timeout (about 30 s each): the existence check that starts every read and write is given
    up on after ASK_LIMIT_S and marks the store down, so the calls after it are misses at once."""
    s = MooncakeStorage(parse_storage(store.uri), rank=0, retry_s=60.0)
    try:
        data = blocks(2, 3)
        s.register(data)
        keys = [b"\x03" * 16, b"\x04" * 16]
        assert s.put_many(keys, list(data)) == data.nbytes
        store.freeze_master()
        out = np.zeros_like(data)
        t0 = time.monotonic()
        assert s.get_many(keys, list(out)) == 0 and not out.any()
        assert s.errors >= 1
        assert s.get_many(keys, list(out)) == 0 and s.put_many(keys, list(data)) == 0 and not s.contains(keys[0])
        assert time.monotonic() - t0 < ASK_LIMIT_S + 10, "one short wait for the frozen master, not one per call"
    finally:
        s.close()


def test_a_set_up_against_a_frozen_master_gives_up_within_seconds(store):
    """The probe answers for a live master and names a frozen one; the client's own set-up
    (which holds the interpreter) fails within seconds under kvrt's client limits, where the
    client's defaults take 30 s."""
    master = f"127.0.0.1:{store.port}"
    assert probe_master(master, "127.0.0.1", 20.0) is None
    store.freeze_master()
    assert "did not finish within 2s" in probe_master(master, "127.0.0.1", 2.0)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="setup with master"):
        open_client(master, "127.0.0.1", 1 << 20)
    assert time.monotonic() - t0 < 15, "a set-up bounded by the client limits"


def test_a_node_started_while_its_master_is_frozen_serves_with_misses(node, tmp_path, store):
    """Setting a client up against a frozen master holds the rank's interpreter for about 30 s
    (no heartbeat, no transfers); a probe process finds the master frozen first, so the node
    starts and serves every request, computed, and counts the store as failing."""
    store.freeze_master()
    prompt = shared_prefix_prompts(seed=9, systems=1, users=1)[0]
    with launched(node, tmp_path, *SMALL, *store.node_opts) as ln:
        res = ln.client.generate(prompt, NEW)
        stats = ln.idle_stats()
    assert res.output_token_ids.tolist() == oracle().generate_dense(prompt, NEW) and res.cached_tokens == 0
    assert stats["storage_errors"] > 0 and stats["failed_requests"] == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_a_prompt_computed_on_one_node_is_a_storage_hit_on_another(node, tmp_path, store, tp):
    """Each rank stores its own head shards; a block is a hit only where every rank read it."""
    prompts = shared_prefix_prompts(seed=5, systems=2, users=2)
    opts = (*SMALL, "--num-gpu-blocks", "128", *store.node_opts, "--tp", str(tp))
    want = [oracle(tp).generate_dense(p, NEW) for p in prompts]
    with launched(node + "a", tmp_path / "a", *opts) as a:
        got_a = [a.client.generate(p, NEW).output_token_ids.tolist() for p in prompts]
        assert a.idle_stats()["tasks_done"] > 0
    assert got_a == want
    with launched(node + "b", tmp_path / "b", *opts) as b:
        res = [b.client.generate(p, NEW) for p in prompts]
        stats = b.idle_stats()
    assert [r.output_token_ids.tolist() for r in res] == want
    assert [r.cached_tokens for r in res] == [(len(p) - 1) // 8 * 8 for p in prompts], \
        "every full block node A computed is found: read from the store, or on the device once read"
    assert res[0].cached_storage == res[0].cached_tokens
    assert stats["hit_tokens_storage"] == sum(r.cached_storage for r in res) > 0
    assert stats["storage_errors"] == 0 and stats["failed_requests"] == 0


def test_a_node_keeps_serving_when_the_master_dies(node, tmp_path, store):
    prompts = shared_prefix_prompts(seed=6, systems=2, users=3)
    opts = (*SMALL, "--num-gpu-blocks", "128", *store.node_opts)
    with launched(node, tmp_path, *opts) as ln:
        before = [ln.client.generate(p, NEW) for p in prompts[:2]]
        ln.idle_stats()  # their write-through is done
        store.kill_master()
        after = [ln.client.generate(p, NEW) for p in prompts]
        stats = ln.idle_stats()
    answers = [r.output_token_ids.tolist() for r in before + after]
    assert answers == [oracle().generate_dense(p, NEW) for p in prompts[:2] + prompts]
    assert stats["failed_requests"] == 0 and stats["tasks_failed"] == 0
    assert stats["storage_errors"] > 0, "store failures are counted as misses"


def test_under_memory_pressure_every_request_finishes_with_store_lookups(node, tmp_path, store):
    """Every request on a shared-store node holds blocks for its whole lookup while the store is
    asked: with a device pool a few requests fill, many at once still all finish, exactly."""
    from kvrt.runtime.client.client import Result

    prompts = shared_prefix_prompts(seed=8, systems=3, users=4)  # 12 prompts of up to 16 blocks
    opts = (*SMALL, "--num-gpu-blocks", "40", "--max-num-seqs", "4", *store.node_opts)
    with launched(node, tmp_path, *opts) as ln:
        for round_ in range(2):  # the second round's prefixes come from the store
            ids = {ln.client.submit(p, NEW, stream=False): i for i, p in enumerate(prompts)}
            got: dict[int, list[int]] = {}
            deadline = time.monotonic() + 120
            while len(got) < len(ids) and time.monotonic() < deadline:
                for ev in ln.client.poll(1.0):
                    assert isinstance(ev, Result), ev
                    got[ids[ev.request_id]] = ev.output_token_ids.tolist()
            assert [got.get(i) for i in range(len(prompts))] == [oracle().generate_dense(p, NEW) for p in prompts]
        stats = ln.idle_stats()
    assert stats["failed_requests"] == 0 and stats["hit_tokens_storage"] > 0


@pytest.mark.alone
def test_blocks_a_dead_master_did_not_take_are_written_after_it_restarts(node, tmp_path, store):
    """A master restart is misses, then a working store again; and a write the dead master
    refused is not taken for done: the read that misses them makes the node forget them, so
    it writes them again when it computes them."""
    rng = np.random.default_rng(4)
    first, *fillers = [rng.integers(0, 512, 6 * 8 + 1).astype(np.int32) for _ in range(5)]
    opts = (*SMALL, "--num-gpu-blocks", "16", *store.node_opts)
    with launched(node + "a", tmp_path / "a", *opts) as a:
        # a first answer once every child is up: the node answers `info` while its cache-transfer
        # child still sets its store client up, and the master must die after that, not during it
        a.client.generate(np.random.default_rng(5).integers(0, 512, 9).astype(np.int32), NEW)
        store.kill_master()
        store.stop()
        assert a.client.generate(first, NEW).cached_tokens == 0
        assert a.idle_stats()["storage_errors"] > 0  # its write-through was refused
        again = Store(tmp_path, port=store.port)  # a new master (empty) on the same address
        store.proc, store.master_pid = again.proc, again.master_pid
        time.sleep(RETRY_S + 0.5)  # the client leaves a master that failed alone this long
        for p in fillers:  # push `first` out of the 16-block device: it is computed again
            a.client.generate(p, NEW)
        res = a.client.generate(first, NEW)
        assert res.cached_tokens == 0
        stats = a.idle_stats()
        assert stats["failed_requests"] == 0
    with launched(node + "b", tmp_path / "b", *opts) as b:
        res = b.client.generate(first, NEW)
    assert res.output_token_ids.tolist() == oracle().generate_dense(first, NEW)
    assert res.cached_storage == 6 * 8, "node A wrote the blocks the dead master had refused"


def test_a_node_started_while_no_master_listens_serves_with_misses(node, tmp_path):
    """Setting a client up with no master would retry for ever: the node starts, serves every
    request (computed) and counts the store as failing."""
    prompt = shared_prefix_prompts(seed=7, systems=1, users=1)[0]
    with launched(node, tmp_path, *SMALL, "--storage", f"mooncake://127.0.0.1:{free_port()}",
                  "--storage-insecure") as ln:
        res = ln.client.generate(prompt, NEW)
        stats = ln.idle_stats()
    assert res.output_token_ids.tolist() == oracle().generate_dense(prompt, NEW) and res.cached_tokens == 0
    assert stats["storage_errors"] > 0 and stats["failed_requests"] == 0


def test_objects_in_memory_a_dead_process_lent_are_misses(node, tmp_path, store):
    """The process that lent the pool its memory dies (the master lives on): every object in
    it is a miss, counted, and the next node computes its prompts with the right answers."""
    prompts = shared_prefix_prompts(seed=10, systems=2, users=1)
    opts = (*SMALL, "--num-gpu-blocks", "64", *store.node_opts)
    with launched(node + "a", tmp_path / "a", *opts) as a:
        for p in prompts:
            a.client.generate(p, NEW)
        a.idle_stats()
    store.proc.kill()  # `kvrt store start` (the lender) only: its master is still up
    store.proc.wait()
    with launched(node + "b", tmp_path / "b", *opts) as b:
        res = [b.client.generate(p, NEW) for p in prompts]
        stats = b.idle_stats()
    assert [r.output_token_ids.tolist() for r in res] == [oracle().generate_dense(p, NEW) for p in prompts]
    assert all(r.cached_storage == 0 for r in res)
    assert stats["storage_errors"] > 0 and stats["failed_requests"] == 0


def test_a_pool_the_store_cannot_address_goes_through_the_staging_area(store):
    """A GPU node's blocks: batches of the registered staging area, the same bytes back."""
    from tests.workers.test_storage_io import CopyingBackend, pool
    from kvrt.workers.storage.io import StagedBlocks

    spec = parse_storage(store.uri)
    a, b = MooncakeStorage(spec, rank=0), MooncakeStorage(spec, rank=0)
    try:
        src, dst = pool(CopyingBackend(), seed=3), pool(CopyingBackend(), seed=4)
        blocks = list(range(100))
        keys = [i.to_bytes(16, "big") for i in blocks]
        assert StagedBlocks(src, a, lambda: None).write(blocks, keys) == 100 * src.block_bytes
        assert StagedBlocks(dst, b, lambda: None).read(blocks, keys, 0.0) == 100
        assert np.array_equal(dst.array[:100], src.array[:100]) and a.errors == b.errors == 0
    finally:
        a.close()
        b.close()


def test_a_sigkilled_store_takes_its_master_with_it(tmp_path):
    """`kvrt store start` killed with SIGKILL runs no cleanup: its Mooncake master still gets
    SIGTERM from the kernel (it used to keep running, holding the port)."""
    s = Store(tmp_path)
    try:
        s.proc.kill()
        s.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(s.master_pid, 0)
            except ProcessLookupError:
                break
            if _zombie(s.master_pid):
                break
            time.sleep(0.1)  # waiting for another process to exit
        else:
            raise AssertionError(f"the master (pid {s.master_pid}) outlived its SIGKILLed store by 10 s")
    finally:
        s.stop()


def _zombie(pid: int) -> bool:
    """Exited but not reaped (its parent is gone, so init reaps it when it gets to it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ---- the store as a trust boundary: forged objects, other groups, listeners ----------------------
def forge_every_object(store: Store) -> int:
    """What a third party that reaches the store does: list the objects on the master's admin
    port and overwrite each kvrt object with as many random bytes, through a client of its own."""
    from urllib.request import urlopen

    from kvrt.workers.storage.mooncake import open_client

    with urlopen(f"http://127.0.0.1:{store.metrics_port}/get_all_keys", timeout=10) as r:
        names = [n for n in r.read().decode().split() if n.startswith("kvrt-")]
    client = open_client(f"127.0.0.1:{store.port}", "127.0.0.1", 0)
    try:
        sizes = [int(client.get_size(n)) for n in names]
        forged = np.random.default_rng(0).integers(0, 256, (len(names), max(sizes, default=1)), dtype=np.uint8)
        assert client.register_buffer(int(forged.ctypes.data), int(forged.nbytes)) == 0
        put = client.batch_upsert_from(names, [int(row.ctypes.data) for row in forged], sizes)
        assert list(put) == [0] * len(names), put
    finally:
        client.close()
    return len(names)


def test_signed_objects_a_third_party_overwrote_are_misses_that_never_reach_the_pool(store):
    from kvrt.workers.storage.mac import BlockMac

    spec = parse_storage(store.uri)
    a = MooncakeStorage(spec, rank=0, mac=BlockMac(b"k" * 32, b"model"))
    b = MooncakeStorage(spec, rank=0, mac=BlockMac(b"k" * 32, b"model"))
    try:
        src, dst = blocks(4, 1), np.zeros((4, 2, 2, 8, 16), np.float32)
        a.register(src)
        b.register(dst)
        keys = [bytes([i + 1]) * 16 for i in range(4)]
        assert a.put_many(keys, list(src)) == 4 * src[0].nbytes
        assert b.get_many(keys, list(dst)) == 4 and np.array_equal(dst, src)
        dst[:] = 0
        assert forge_every_object(store) == 4
        assert b.get_many(keys, list(dst)) == 0 and not dst.any(), "not a byte of a forged object reaches the pool"
        assert b.forged == 1 and b.errors == 0
        assert b.exists_many(keys[:1]) == 0, "the forged object is removed, so the real block can be written again"
        a.put_many(keys, list(src))
        assert b.get_many(keys, list(dst)) == 1 and np.array_equal(dst[0], src[0]) and b.forged == 2
        unsigned = MooncakeStorage(spec, rank=0)  # an object without a MAC is forged too
        unsigned.register(src)
        unsigned.put_many([b"\x09" * 16], [src[0]])
        unsigned.close()
        assert b.get_many([b"\x09" * 16], [dst[0]]) == 0 and b.forged == 3
    finally:
        a.close()
        b.close()


def test_a_node_answers_right_after_a_third_party_forged_the_store(node, tmp_path, store):
    prompts = shared_prefix_prompts(seed=12, systems=2, users=1)
    opts = (*SMALL, "--num-gpu-blocks", "64", *store.node_opts)
    with launched(node + "a", tmp_path / "a", *opts) as a:
        for p in prompts:
            a.client.generate(p, NEW)
        a.idle_stats()  # its write-through is done
    assert forge_every_object(store) > 0
    with launched(node + "b", tmp_path / "b", *opts) as b:
        res = [b.client.generate(p, NEW) for p in prompts]
        stats = b.idle_stats()
    assert [r.output_token_ids.tolist() for r in res] == [oracle().generate_dense(p, NEW) for p in prompts]
    assert all(r.cached_storage == 0 for r in res)
    assert stats["storage_forged"] > 0 and stats["failed_requests"] == 0


def test_a_node_with_another_secret_gets_none_of_its_blocks_served(node, tmp_path, store):
    prompts = shared_prefix_prompts(seed=13, systems=2, users=1)
    base = (*SMALL, "--num-gpu-blocks", "64", "--storage", store.uri)
    with launched(node + "x", tmp_path / "x", *base, "--storage-secret-file", pd_secret_file(tmp_path, "store")) as x:
        for p in prompts:
            x.client.generate(p, NEW)
        x.idle_stats()
    with launched(node + "b", tmp_path / "b", *base, "--storage-secret-file", store.secret) as b:
        res = [b.client.generate(p, NEW) for p in prompts]
        stats = b.idle_stats()
    assert [r.output_token_ids.tolist() for r in res] == [oracle().generate_dense(p, NEW) for p in prompts]
    assert all(r.cached_storage == 0 for r in res)
    assert stats["storage_forged"] > 0 and stats["failed_requests"] == 0


def _listeners(pid: int) -> list[str]:
    import psutil

    return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(pid).net_connections(kind="tcp")
                  if c.status == psutil.CONN_LISTEN)


def test_the_store_listens_on_its_host_and_names_what_it_cannot_confine(store):
    """The master binds --host (RPC and its admin/metrics server); the lender's transfer engine
    (Mooncake 0.3 wheels) ignores the bind address: every listener of it that is not on --host
    is named in the store's warning."""
    master = _listeners(store.master_pid)
    assert f"127.0.0.1:{store.port}" in master and f"127.0.0.1:{store.metrics_port}" in master
    assert all(a.startswith("127.0.0.1:") for a in master), master
    with open(store.stderr) as f:
        err = f.read()
    for addr in _listeners(store.proc.pid):
        assert addr.startswith("127.0.0.1:") or addr in err.split("listens on ")[1].split(" although")[0], \
            (addr, err[-2000:])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_store_stops_its_master(tmp_path, sig):
    """`kill` (or Ctrl-C) of `kvrt store start`: it exits and its master with it (the master
    used to keep running, holding the port and every object)."""
    s = Store(tmp_path)
    try:
        s.proc.send_signal(sig)
        s.proc.wait(20)
        deadline = time.monotonic() + 10
        while not _zombie(s.master_pid):
            assert time.monotonic() < deadline, f"the master (pid {s.master_pid}) outlived its stopped store by 10 s"
            time.sleep(0.1)  # waiting for another process to exit
    finally:
        s.stop()


def test_a_store_whose_master_froze_still_stops_and_says_so(tmp_path):
    """Its client's goodbye to a master that answers nothing waited for ever (a store stopped
    with SIGINT was still there a minute later): the goodbye is skipped, the master that
    ignores SIGTERM is killed after MASTER_STOP_S, and the store says so."""
    from kvrt.workers.storage.mooncake import MASTER_STOP_S

    s = Store(tmp_path)
    try:
        s.freeze_master()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(MASTER_STOP_S + 15) == 0
        assert _zombie(s.master_pid)
        with open(s.stderr) as f:
            assert f"did not exit within {MASTER_STOP_S:g} s of SIGTERM: killed" in f.read()
    finally:
        s.stop()


def test_a_node_serves_right_after_a_third_party_removed_every_object(node, tmp_path, store):
    """What anyone who reaches the master's admin port can do (`POST /api/v1/remove_all`): the
    nodes on the store see misses, compute again and answer right, and keep serving."""
    from urllib.request import Request, urlopen

    prompts = shared_prefix_prompts(seed=14, systems=2, users=1)
    want = [oracle().generate_dense(p, NEW) for p in prompts]
    opts = (*SMALL, "--num-gpu-blocks", "64", *store.node_opts)
    with launched(node + "a", tmp_path / "a", *opts) as a:
        for p in prompts:
            a.client.generate(p, NEW)
        a.idle_stats()  # its write-through is done
        with urlopen(Request(f"http://127.0.0.1:{store.metrics_port}/api/v1/remove_all", method="POST"),
                     timeout=10) as r:
            assert r.status == 200
        with launched(node + "b", tmp_path / "b", *opts) as b:
            res = [b.client.generate(p, NEW) for p in prompts]
            stats = b.idle_stats()
        assert [r.output_token_ids.tolist() for r in res] == want
        assert all(r.cached_storage == 0 for r in res) and stats["failed_requests"] == 0
        a.client.reset_prefix_cache()  # (A, too, must go to the store now)
        assert [a.client.generate(p, NEW).output_token_ids.tolist() for p in prompts] == want
        assert a.proc.poll() is None, a.logs()
