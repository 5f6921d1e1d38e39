"""The swap path of cache-transfer with GPU semantics, on any machine.

Unit tests drive `CacheTransfer.serve` with an asynchronous fake backend (copies issued, landing
only when waited for: what CuPy does) and a fake ring and child, and check the order of issues,
waits and answers: queued tasks taken together, the next tasks' copies issued before the oldest
is answered, one wait per task, answers in task order; and on a synchronous backend (numpy,
a CPU node) each task answered before the next starts, as before. The last test sends bursts
through the ring to a real cache-transfer process and checks every byte and every answer."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import xxhash

from kvrt.ipc import protocol
from kvrt.ipc.errors import WaitTimeout
from kvrt.ipc.protocol import PROTOCOL, Shutdown, TransferTask
from tests.nodekit import NodeKit
from kvrt.workers.backend import NumpyBackend, Pool
from kvrt.workers.cache_transfer import CacheTransfer
from kvrt.workers.child import Child
from kvrt.workers.kv_pool import attach_pools, copy_blocks, start_copy

I32 = np.int32


class LogBackend(NumpyBackend):
    """numpy copies that say what they do; `asynchronous` ones land only when waited for."""

    def __init__(self, log: list, asynchronous: bool):
        self.log, self.asynchronous, self.marks = log, asynchronous, 0

    def copy_runs(self, dst, src, runs):
        self.log.append(("copy", len(runs)))
        super().copy_runs(dst, src, runs)

    def issue_runs(self, dst, src, runs):
        if not self.asynchronous:
            return super().issue_runs(dst, src, runs)
        super().copy_runs(dst, src, runs)
        self.marks += 1
        self.log.append(("issue", self.marks))
        return self.marks

    def is_done(self, mark):
        return False  # only a wait lands the bytes

    def wait(self, mark):
        self.log.append(("wait", mark))


class FakeRing:
    """The task ring: batches of records handed out as a real ring would find them queued."""

    def __init__(self, batches: list[list[bytes]]):
        self.batches = deque(batches)

    def pending(self) -> bool:
        return bool(self.batches)

    def get_many(self, max_records: int, timeout: float) -> list[bytes]:
        if not self.batches:
            raise WaitTimeout("fake ring: nothing queued")
        batch = self.batches.popleft()
        if len(batch) > max_records:
            self.batches.appendleft(batch[max_records:])
        return batch[:max_records]

    def get(self, timeout: float) -> bytes:  # the one-at-a-time loop of other roles
        rec = self.get_many(1, timeout)[0]
        return rec

    def report_protocol_error(self, logger, err) -> None:
        raise AssertionError(f"unexpected protocol error: {err}")


class FakeChild:
    """What a role's server needs of its Child: answers are logged instead of published."""

    serve_orders = Child.serve_orders

    def __init__(self, log: list):
        self.log = log

    def tick(self) -> None:  # where a SIGTERM or an orphaned process would stop the loop
        self.log.append(("tick",))

    def beat(self) -> None:
        pass

    def set_ready(self) -> None:
        pass

    def answer(self, answers, msg) -> None:
        self.log.append(("answer", msg.task_id, msg.ok))


def pools(backend, n: int = 16) -> tuple[Pool, Pool]:
    shape = (n, 2, 2, 4, 2, 8)
    dev = Pool("dev", np.random.default_rng(0).random(shape).astype(np.float16), backend, True, lambda: None)
    host = Pool("host", np.zeros(shape, np.float16), backend, False, lambda: None)
    return dev, host


def transfer(log: list, asynchronous: bool, batches: list[list[bytes]]) -> CacheTransfer:
    """A CacheTransfer over in-memory pools, a fake ring and a fake child (no process)."""
    backend = LogBackend(log, asynchronous)
    ct = CacheTransfer.__new__(CacheTransfer)
    ct.child, ct.rank, ct.owners, ct.storage, ct.blocks = FakeChild(log), 0, {}, None, None
    ct.device, ct.host = pools(backend)
    ct.tasks = SimpleNamespace(ring=FakeRing(batches), name="fake.tasks", decode=PROTOCOL.decode)
    ct.answers, ct.running = None, deque()
    return ct


def swap(tid: int, kind: str, dev, host) -> bytes:
    return PROTOCOL.encode(TransferTask(tid, kind, np.asarray(dev, I32), np.asarray(host, I32)))


def serve(ct: CacheTransfer) -> list:
    """Serve until Shutdown; the log without its ticks."""
    ct.child.cfg = SimpleNamespace(storage="")
    ct._list_storage = lambda: None
    assert ct.serve() == 0
    return [e for e in ct.child.log if e[0] != "tick"]


def test_queued_tasks_are_issued_together_and_answered_in_order_after_one_wait_each():
    log: list = []
    burst = [swap(1, protocol.SWAP2CPU, [1, 2, 3], [4, 5, 6]), swap(2, protocol.SWAP2CPU, [7], [8]),
             swap(3, protocol.SWAP2GPU, [9, 10], [4, 5])]
    ct = transfer(log, True, [burst, [PROTOCOL.encode(Shutdown("test"))]])
    log = serve(ct)
    # all three tasks' copies were on the (fake) stream before the first answer went out
    assert log == [("issue", 1), ("issue", 2), ("issue", 3),
                   ("wait", 1), ("answer", 1, True), ("wait", 2), ("answer", 2, True),
                   ("wait", 3), ("answer", 3, True)]
    assert np.array_equal(ct.host.array[[4, 5, 6, 8]], ct.device.array[[1, 2, 3, 7]])
    assert np.array_equal(ct.device.array[[9, 10]], ct.device.array[[1, 2]])


def test_a_task_arriving_while_copies_are_in_flight_is_issued_before_the_wait():
    log: list = []
    ct = transfer(log, True, [[swap(1, protocol.SWAP2CPU, [1], [1])], [swap(2, protocol.SWAP2CPU, [2], [2])],
                              [PROTOCOL.encode(Shutdown("test"))]])
    log = serve(ct)
    assert log[:3] == [("issue", 1), ("issue", 2), ("wait", 1)], log
    assert [e for e in log if e[0] == "answer"] == [("answer", 1, True), ("answer", 2, True)]


def test_shutdown_answers_what_is_in_flight_first():
    log: list = []
    ct = transfer(log, True, [[swap(1, protocol.SWAP2CPU, [1], [1]), PROTOCOL.encode(Shutdown("test")),
                               swap(2, protocol.SWAP2CPU, [2], [2])]])
    log = serve(ct)
    assert log == [("issue", 1), ("wait", 1), ("answer", 1, True)]


def test_a_bad_task_in_a_batch_is_answered_alone_in_its_turn():
    log: list = []
    ct = transfer(log, True, [[swap(1, protocol.SWAP2CPU, [1], [1]), swap(2, protocol.SWAP2CPU, [99], [2]),
                               swap(3, protocol.SWAP2CPU, [3], [3])], [PROTOCOL.encode(Shutdown("test"))]])
    log = serve(ct)
    assert log == [("issue", 1), ("issue", 2), ("wait", 1), ("answer", 1, True), ("answer", 2, False),
                   ("wait", 2), ("answer", 3, True)]


def test_a_stop_is_looked_at_only_when_no_copy_is_in_flight():
    log: list = []
    burst = [swap(1, protocol.SWAP2CPU, [1], [1]), swap(2, protocol.SWAP2CPU, [2], [2])]
    ct = transfer(log, True, [burst, [swap(3, protocol.SWAP2CPU, [3], [3])], [PROTOCOL.encode(Shutdown("test"))]])
    serve(ct)
    events = [e[0] for e in ct.child.log]
    first_issue, last_answer = events.index("issue"), len(events) - 1 - events[::-1].index("answer")
    assert "tick" not in events[first_issue:last_answer], events


def test_close_lets_copies_in_flight_land_before_the_pools_go():
    log: list = []
    ct = transfer(log, True, [])
    ct.device.release = ct.host.release = lambda: log.append(("released",))
    ct.answers = SimpleNamespace(close=lambda: log.append(("answers closed",)))
    ct.tasks.detach = lambda: None
    ct.running.append(ct.start(TransferTask(1, protocol.SWAP2CPU, np.array([1], I32), np.array([2], I32))))
    ct.close()
    assert log == [("issue", 1), ("answers closed",), ("wait", 1), ("released",), ("released",)]


def test_on_a_cpu_each_task_is_answered_before_the_next_starts():
    log: list = []
    burst = [swap(1, protocol.SWAP2CPU, [1, 2], [4, 5]), swap(2, protocol.SWAP2CPU, [7], [8]),
             swap(3, protocol.SWAP2GPU, [9], [4])]
    ct = transfer(log, False, [burst, [PROTOCOL.encode(Shutdown("test"))]])
    log = serve(ct)
    assert log == [("copy", 1), ("answer", 1, True), ("copy", 1), ("answer", 2, True),
                   ("copy", 1), ("answer", 3, True)]


def test_a_device_copy_is_one_mark_per_beat_batch_and_beats_while_it_lands(monkeypatch):
    log: list = []
    dev, host = pools(LogBackend(log, True))
    monkeypatch.setattr("kvrt.workers.kv_pool.BEAT_BYTES", 4 * dev.block_bytes)
    job = start_copy(host, dev, np.arange(16), np.arange(16)[::-1])  # 16 single-block runs
    assert log == [("issue", 1), ("issue", 2), ("issue", 3), ("issue", 4)] and not job.done()
    beats: list = []
    assert job.wait(lambda: beats.append(1)) == 16 * dev.block_bytes
    assert log[4:] == [("wait", 1), ("wait", 2), ("wait", 3), ("wait", 4)] and len(beats) == 4
    assert job.done() and np.array_equal(host.array, dev.array[::-1])
    with pytest.raises(ValueError, match="block id 16 out of range"):
        start_copy(host, dev, [0], [16])
    assert copy_blocks(host, dev, [0, 1], [2, 3]) == 2 * dev.block_bytes  # issued and waited for


@pytest.mark.e2e
def test_bursts_through_a_real_process_keep_every_byte_and_the_order(node, tmp_path):
    """Tasks sent back to back (taken together by the cache-transfer), each depending on the one
    before: a block swapped out, then back into another device block, in the same burst."""
    rng = np.random.default_rng(3)
    with NodeKit.create(node, tmp_path, tp=1) as kit:
        kit.start_transfer()
        dev, host = attach_pools(kit.reg, 0, kit.cfg)
        try:
            dev.array[:] = rng.random(dev.array.shape, dtype=np.float32)
            sums = {b: xxhash.xxh3_64_intdigest(dev.array[b].tobytes()) for b in range(32)}
            tasks, expect = [], {}
            for i in range(16):  # device block i -> host block 40 + i -> device block 32 + i
                tasks.append(TransferTask(2 * i + 1, protocol.SWAP2CPU, np.array([i], I32), np.array([40 + i], I32)))
                tasks.append(TransferTask(2 * i + 2, protocol.SWAP2GPU, np.array([32 + i], I32), np.array([40 + i], I32)))
                expect[32 + i] = sums[i]
            out, answers = kit.ends(0)
            for t in tasks:
                out.put(PROTOCOL.encode(t), 5.0)
            got = [PROTOCOL.decode(answers.get(20.0)) for _ in tasks]
            assert [(a.task_id, a.ok, a.blocks) for a in got] == [(t.task_id, True, 1) for t in tasks]
            assert {b: xxhash.xxh3_64_intdigest(dev.array[b].tobytes()) for b in expect} == expect
        finally:
            dev.close()
            host.close()


class FakeRuntime:
    """The few CUDA runtime calls the CuPy backend's copies make, logged (no GPU needed)."""

    def __init__(self, log: list):
        self.log, self.events, self.landed = log, 0, set()

    def streamCreateWithFlags(self, flags):
        return 77

    def memcpyAsync(self, dst, src, nbytes, kind, stream):
        self.log.append(("memcpyAsync", dst, src, nbytes, stream))

    def eventCreateWithFlags(self, flags):
        self.events += 1
        self.log.append(("eventCreate", self.events))
        return self.events

    def eventRecord(self, event, stream):
        self.log.append(("eventRecord", event, stream))

    def eventQuery(self, event):
        return 0 if event in self.landed else 600  # cudaErrorNotReady

    def eventSynchronize(self, event):
        self.log.append(("eventSynchronize", event))
        self.landed.add(event)

    def streamSynchronize(self, stream):
        raise AssertionError("a swap waits on its event, never on the whole stream")


def test_cupy_copies_are_issued_on_its_stream_and_waited_on_one_reused_event():
    from kvrt.workers.backend import CupyBackend

    log: list = []
    b = CupyBackend.__new__(CupyBackend)
    b.rt, b._stream, b._staging, b._events = FakeRuntime(log), 0, None, []
    bb = 1024
    dev = Pool("dev", SimpleNamespace(shape=(8,), nbytes=8 * bb, data=SimpleNamespace(ptr=1 << 20)), b, True,
               lambda: None)
    host = Pool("host", SimpleNamespace(shape=(8,), nbytes=8 * bb, ctypes=SimpleNamespace(data=1 << 30)), b, False,
                lambda: None)
    mark = b.issue_runs(host, dev, [(2, 5, 3), (0, 1, 1)])
    assert log == [("memcpyAsync", (1 << 30) + 5 * bb, (1 << 20) + 2 * bb, 3 * bb, 77),
                   ("memcpyAsync", (1 << 30) + bb, 1 << 20, bb, 77), ("eventCreate", 1), ("eventRecord", 1, 77)]
    assert not b.is_done(mark)
    b.wait(mark)
    assert b.is_done(mark) and log[-1] == ("eventSynchronize", 1)
    del log[:]
    b.copy_runs(dev, host, [(0, 0, 1)])  # the event is reused: none made per task
    assert log == [("memcpyAsync", 1 << 20, 1 << 30, bb, 77), ("eventRecord", 1, 77), ("eventSynchronize", 1)]


def test_cupy_storage_staging_is_pinned_and_one_wait_per_batch(tmp_path):
    """A storage task on a GPU node stages through pinned memory, a batch's copies issued
    together with one event wait (not a stream synchronise per block from pageable memory)."""
    from kvrt.workers.backend import CupyBackend
    from kvrt.workers.storage.base import FileStorage
    from kvrt.workers.storage.io import StagedBlocks

    log: list = []
    pinned: list = []

    def alloc_pinned_memory(nbytes: int) -> bytearray:
        pinned.append(nbytes)
        return bytearray(nbytes)

    b = CupyBackend.__new__(CupyBackend)
    b.rt, b._stream, b._events = FakeRuntime(log), 0, []
    b.cp = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=alloc_pinned_memory))
    bb = 256
    dev = Pool("dev", SimpleNamespace(shape=(100, 64), dtype=np.dtype(np.float32), nbytes=100 * bb,
                                      data=SimpleNamespace(ptr=1 << 20)), b, True, lambda: None)
    io = StagedBlocks(dev, FileStorage(str(tmp_path), 0), lambda: None, stage_blocks=8)
    assert pinned == [8 * bb] and io.stage.shape == (8, 64)
    keys = [i.to_bytes(16, "little") for i in range(10)]
    io.write(list(range(10)), keys)
    assert [e[0] for e in log].count("memcpyAsync") == 10
    assert [e[0] for e in log if e[0] != "memcpyAsync"] == ["eventCreate", "eventRecord", "eventSynchronize",
                                                            "eventRecord", "eventSynchronize"]
    del log[:]
    assert io.read(list(range(20, 30)), keys, 0.0) == 10
    assert [e[0] for e in log if e[0] != "memcpyAsync"] == ["eventRecord", "eventSynchronize"] * 2
