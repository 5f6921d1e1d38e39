"""cache-transfer as a real process: a node built by hand (tests/nodekit.py), this test as the
launcher, the engine and the worker, and `python -m kvrt.workers.cache_transfer` children."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import xxhash

from kvrt.ipc import protocol
from kvrt.ipc.errors import ChannelClosed
from kvrt.ipc.protocol import PROTOCOL, Shutdown, TransferDone, TransferTask
from kvrt.ipc.registry import pid_alive, reclaim
from tests.conftest import REPO, leftovers, spawn_py
from tests.nodekit import NodeKit
from kvrt.workers.kv_pool import attach_pools

pytestmark = pytest.mark.e2e

I32 = np.int32


def task(tid, kind, dev=(), host=(), keys=()):
    return TransferTask(tid, kind, np.asarray(dev, I32), np.asarray(host, I32), list(keys))


def sums(pool, blocks) -> list[int]:
    return [xxhash.xxh3_64_intdigest(pool.array[b].tobytes()) for b in blocks]


def fill_random(kit: NodeKit) -> list:
    """Attach every rank's pools (as the worker would) and fill the device pools with noise."""
    pools = [attach_pools(kit.reg, r, kit.cfg) for r in range(kit.cfg.tp)]
    for r, (dev, _) in enumerate(pools):
        dev.array[:] = np.random.default_rng(r).random(dev.array.shape, dtype=np.float32)
    return pools


def close_pools(pools) -> None:
    for dev, host in pools:
        dev.close()
        if host is not None:
            host.close()


def assert_all_ok(answers: list[TransferDone], tid: int, blocks: int) -> None:
    assert [(a.task_id, a.rank, a.ok, a.blocks) for a in answers] == \
        [(tid, r, True, blocks) for r in range(len(answers))], answers


def test_swap_out_and_back_keeps_every_block_intact(node, tmp_path):
    rng = np.random.default_rng(7)
    with NodeKit.create(node, tmp_path, tp=2) as kit:
        kit.start_transfer()
        pools = fill_random(kit)
        # a run of 8 consecutive pairs, then 24 scattered ones
        dev = np.concatenate([np.arange(4, 12), rng.choice(np.arange(12, 64), 24, replace=False)])
        host = np.concatenate([np.arange(30, 38), rng.choice(30, 24, replace=False)])
        before = [sums(d, dev) for d, _ in pools]
        answers = kit.request(task(1, protocol.SWAP2CPU, dev, host))
        assert_all_ok(answers, 1, 32)
        assert all(a.nbytes == 32 * pools[0][0].block_bytes and a.seconds > 0 for a in answers)
        for r, (d, h) in enumerate(pools):
            assert sums(h, host) == before[r]
            d.array[dev] = 0  # the device copies are gone (evicted, reused)
        back = rng.permutation(64)[:32]  # swapped in to other device blocks
        assert_all_ok(kit.request(task(2, protocol.SWAP2GPU, back, host)), 2, 32)
        for r, (d, _) in enumerate(pools):
            assert sums(d, back) == before[r]
        assert before[0] != before[1]  # each rank moved its own bytes
        close_pools(pools)


def test_storage_round_trip_and_damaged_objects_are_short_reads(node, tmp_path):
    store = tmp_path / "store"
    with NodeKit.create(node, tmp_path, tp=2, num_cpu_blocks=0, storage=f"file:{store}") as kit:
        kit.start_transfer()
        pools = fill_random(kit)
        bb = pools[0][0].block_bytes
        keys = [os.urandom(16) for _ in range(6)]
        src = [3, 9, 10, 11, 40, 2]
        before = [sums(d, src) for d, _ in pools]
        answers = kit.request(task(1, protocol.GPU2STORAGE, src, keys=keys))
        assert_all_ok(answers, 1, 6)
        assert [a.nbytes for a in answers] == [6 * bb, 6 * bb]
        assert len([f for _, _, fs in os.walk(store) for f in fs]) == 12  # one file per (key, rank)
        again = kit.request(task(2, protocol.GPU2STORAGE, src[:2] + [5], keys=keys[:2] + [os.urandom(16)]))
        assert [a.nbytes for a in again] == [bb, bb]  # present keys are skipped
        for d, _ in pools:
            d.array[:] = 0
        dst = [20, 21, 22, 23, 24, 25]
        assert_all_ok(kit.request(task(3, protocol.STORAGE2GPU, dst, keys=keys)), 3, 6)
        for r, (d, _) in enumerate(pools):
            assert sums(d, dst) == before[r]
        # rank 0's 4th object corrupt, rank 1's 3rd missing: each reads its intact prefix
        p = os.path.join(store, keys[3][:1].hex(), keys[3].hex() + ".r0.kvb")
        data = open(p, "rb").read()
        open(p, "wb").write(data[:-1] + bytes([data[-1] ^ 0xFF]))
        os.unlink(os.path.join(store, keys[2][:1].hex(), keys[2].hex() + ".r1.kvb"))
        answers = kit.request(task(4, protocol.STORAGE2GPU, [30, 31, 32, 33, 34, 35], keys=keys))
        assert [(a.ok, a.blocks, a.nbytes) for a in answers] == [(True, 3, 3 * bb), (True, 2, 2 * bb)]
        assert "corrupt (checksum mismatch)" in kit.log_text(0)
        # a swap on a node without a host pool is refused, not fatal
        bad = kit.request(task(5, protocol.SWAP2CPU, [1], [1]))
        assert not bad[0].ok and "no host pool" in bad[0].error
        assert all(p.poll() is None for p in kit.procs.values())
        close_pools(pools)


def test_bad_tasks_fail_alone_and_the_process_lives_on(node, tmp_path):
    with NodeKit.create(node, tmp_path, tp=2) as kit:
        kit.start_transfer()
        cases = [
            (task(1, protocol.SWAP2CPU, [1, 64], [0, 1]), "device block id 64 out of range 0..63"),
            (task(2, protocol.SWAP2GPU, [1], [-3]), "host block id -3 out of range"),
            (task(3, protocol.SWAP2CPU, [1, 2], [3]), "2 device blocks paired with 1 host blocks"),
            (task(4, "defrag", [1], [1]), "unknown task kind 'defrag'"),
            (task(7, ["swap2cpu"], [1], [1]), "unknown task kind ['swap2cpu']"),  # not even a name
            (task(5, protocol.STORAGE2GPU, [1], keys=[b"k" * 16]), "no storage backend"),
        ]
        for t, error in cases:
            answers = kit.request(t)
            for r, a in enumerate(answers):
                assert (a.task_id, a.rank, a.ok, a.blocks) == (t.task_id, r, False, 0)
                assert error in a.error and f"task {t.task_id} ({t.kind}) on cache-transfer[{r}]" in a.error
        assert_all_ok(kit.request(task(6, protocol.SWAP2CPU, [1, 2], [3, 4])), 6, 2)
        assert all(p.poll() is None for p in kit.procs.values())


def test_malformed_messages_are_counted_and_skipped(node, tmp_path):
    with NodeKit.create(node, tmp_path, tp=1) as kit:
        kit.start_transfer()
        kit.send(b"\xc1 not msgpack")
        kit.send(PROTOCOL.encode(TransferDone(1, 0, True)))  # a valid message of the wrong kind
        kit.send(b"\x82\xa1t\xadtransfer_task\xa1v\x63")  # right type, unknown version
        kit.send(PROTOCOL.encode(task("seven", protocol.SWAP2CPU)))  # a task id nobody can match
        assert_all_ok(kit.request(task(2, protocol.SWAP2CPU, [0], [0])), 2, 1)
        out, _ = kit.ends(0)
        assert out.stats()["protocol_errors"] == 4
        log = kit.log_text(0)
        # one line for the four: the log filter holds back warnings of one kind (ipc/log_limit.py)
        assert log.count("skipped: undecodable message") == 1 and "unexpected TransferDone" not in log
        assert kit.procs[0].poll() is None


def test_heartbeat_ready_and_shutdown(node, tmp_path):
    with NodeKit.create(node, tmp_path, tp=2) as kit:
        kit.start_transfer()
        hb = kit.signals[protocol.HEARTBEAT].array
        procs = kit.signals[protocol.PROCS].array
        for r in range(2):
            row = procs[kit.slot(r)]
            assert (row[protocol.PROC_PID], row[protocol.PROC_ROLE], row[protocol.PROC_RANK]) == \
                (kit.procs[r].pid, protocol.ROLE_TRANSFER, r)
        seen, worst = set(), 0
        t_end = time.monotonic() + 1.2
        while time.monotonic() < t_end:  # idle, yet beating (every WAIT_S = 0.2 s when not starved)
            seen.add(int(hb[kit.slot(0)]))
            worst = max(worst, time.monotonic_ns() - min(hb[kit.slot(r)] for r in range(2)))
            time.sleep(0.05)
        assert len(seen) >= 4 and worst < 1.0e9, (len(seen), worst)
        kit.send(Shutdown("test"), [0])
        assert kit.procs[0].wait(10) == 0
        assert kit.signals[protocol.READY].array[kit.slot(0)] == 0
        with pytest.raises(ChannelClosed):  # rank 0 closed its answer ring on the way out
            kit.ends(0)[1].get(1.0)
        kit.procs[1].send_signal(signal.SIGTERM)
        assert kit.procs[1].wait(10) == 0
        assert "stopping: SIGTERM" in kit.log_text(1)


def test_ownership_violation_fails_loudly(node, tmp_path):
    with NodeKit.create(node, tmp_path, tp=1, check_ownership=True) as kit:
        kit.start_transfer()
        dev_owner = kit.signals[protocol.OWNERS_DEVICE].array
        host_owner = kit.signals[protocol.OWNERS_HOST].array
        dev_owner[[1, 2, 3]] = protocol.OWNER_TRANSFER
        host_owner[[4, 5, 6]] = protocol.OWNER_TRANSFER
        assert_all_ok(kit.request(task(1, protocol.SWAP2CPU, [1, 2, 3], [4, 5, 6])), 1, 3)
        dev_owner[2] = protocol.OWNER_WORKER  # the engine's bug: the worker is computing into it
        (a,) = kit.request(task(2, protocol.SWAP2CPU, [1, 2, 3], [4, 5, 6]))
        assert not a.ok and a.error.startswith("ownership violation in task 2 (swap2cpu) on cache-transfer[0]")
        assert "device block 2 is owned by worker, not cache-transfer" in a.error
        dev_owner[2] = protocol.OWNER_TRANSFER
        host_owner[6] = protocol.OWNER_CACHE
        (a,) = kit.request(task(3, protocol.SWAP2GPU, [1, 2, 3], [4, 5, 6]))
        assert not a.ok and "host block 6 is owned by prefix-cache" in a.error
        assert "ERROR cache-transfer[0] kvrt.workers.cache_transfer: ownership violation in task 3" in kit.log_text(0)
        assert kit.procs[0].poll() is None


FAKE_LAUNCHER = """
import sys, time
from tests.nodekit import NodeKit
kit = NodeKit.create(sys.argv[1], sys.argv[2], tp=1, num_gpu_blocks=8, num_cpu_blocks=8)
kit.start_transfer()
print(kit.procs[0].pid, flush=True)
time.sleep(120)
"""


@pytest.mark.alone
def test_orphan_exits_by_itself_when_its_launcher_is_killed(node, tmp_path):
    fake = spawn_py(FAKE_LAUNCHER, node, str(tmp_path))
    pid = 0
    try:
        line = fake.stdout.readline()
        assert line.strip().isdigit(), fake.stderr.read()
        pid = int(line)
        assert pid_alive(pid)
        fake.send_signal(signal.SIGKILL)
        fake.wait(10)
        t0 = time.monotonic()
        while pid_alive(pid) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not pid_alive(pid), "orphaned cache-transfer still running"
        assert time.monotonic() - t0 < 6
        log = open(tmp_path / "cache-transfer.0.log").read()
        assert "orphaned, exiting: launcher" in log
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait()
        if pid_alive(pid):
            psutil.Process(pid).kill()
        reclaim(node)
    assert not leftovers(node)


def test_joining_a_missing_node_fails_with_a_message(node):
    r = subprocess.run([sys.executable, "-m", "kvrt.workers.cache_transfer", "--node", node, "--rank", "0"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"cannot join node {node}" in r.stderr


def test_bench_copy_json_quick():
    """The CPU mode of `kvrt bench copy` (the code the GPU mode runs, numpy as the array module)."""
    bench = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "bench", "copy", "--json", "--pool-blocks", "64",
                              "--blocks", "32", "--tasks", "20", "--e2e-blocks", "1,8", "--num-layers", "2"],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = bench.communicate(timeout=120)
    assert bench.returncode == 0, err
    report = json.loads(out)
    assert (report["device"], report["block_bytes"]) == ("cpu", 2 * 2 * 16 * 8 * 128 * 2)
    rows = report["rows"]
    assert [(x["case"], x["blocks"]) for x in rows] == [
        ("limit h2d", 32), ("limit d2h", 32), ("loop h2d", 32), ("loop d2h", 32), ("swap2gpu", 32),
        ("swap2cpu", 32), ("fancy", 32), ("e2e swap2cpu", 1), ("e2e swap2gpu", 1), ("e2e swap2cpu", 8),
        ("e2e swap2gpu", 8), ("e2e burst", 1)]
    assert all(x["gb_s"] > 0 and x["vs_limit"] > 0 and x["limit_us"] > 0 for x in rows)
    assert rows[0]["vs_limit"] == rows[1]["vs_limit"] == 1.0
    assert all(x["p50_us"] <= x["p99_us"] for x in rows[7:])
    assert all(x["copy_p50_us"] < x["p50_us"] for x in rows[7:11])
    assert not leftovers(f"benchcopy{bench.pid}")  # the bench's node is gone


def test_bench_copy_on_cuda_without_cuda_says_so_in_one_line():
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, or CuPy without a driver or a device
        gpus = 0
    if gpus:
        pytest.skip("CUDA is here: tests/workers/test_gpu.py runs the GPU mode")
    r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "copy", "--device", "cuda"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("kvrt bench copy: --device cuda cannot run here: ") and r.stderr.count("\n") == 1


def test_a_task_that_waited_past_its_deadline_touches_no_block(node, tmp_path):
    """A cache-transfer rank paused (SIGSTOP) until its task's deadline passed -- by then the
    engine gave up and may have reused the blocks -- answers it failed and copies nothing."""
    with NodeKit.create(node, tmp_path, tp=1) as kit:
        kit.start_transfer()
        pools = fill_random(kit)
        try:
            dev, host = pools[0]
            proc = psutil.Process(kit.procs[0].pid)
            proc.suspend()
            try:
                late = task(1, protocol.SWAP2CPU, [1, 2], [3, 4])
                late.deadline = time.monotonic() + 0.2
                kit.send(late)
                while time.monotonic() < late.deadline:
                    time.sleep(0.05)  # the rank stays stopped until the deadline has passed
            finally:
                proc.resume()
            answer = PROTOCOL.decode(kit.ends(0)[1].get(10.0))
            assert (answer.task_id, answer.ok) == (1, False) and "expired" in answer.error, answer
            assert not host.array[[3, 4]].any(), "an expired task copied blocks"
            on_time = task(2, protocol.SWAP2CPU, [1, 2], [3, 4])
            on_time.deadline = time.monotonic() + 30
            assert_all_ok(kit.request(on_time), 2, 2)
            assert sums(host, [3, 4]) == sums(dev, [1, 2])
        finally:
            close_pools(pools)
