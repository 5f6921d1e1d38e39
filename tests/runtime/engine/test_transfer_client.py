"""The engine side of cache-transfer tasks: complete on all ranks, fail on a silent rank, and
the ownership race detector refusing a wrong hand-over."""
import numpy as np
import pytest

from kvrt.ipc import protocol as P
from kvrt.ipc.registry import Registry
from kvrt.ipc.channel import Receiver, Sender
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.engine.ownership import TASK_SOURCES, OwnerTable, OwnershipError
from kvrt.runtime.engine.transfer import TransferClient


@pytest.fixture
def ranks(node):
    with Registry.create(node) as reg:
        for r in range(2):
            P.transfer_orders(r).create(reg, capacity=1 << 14)
        out = [Sender.attach(reg, P.transfer_orders(r)) for r in range(2)]
        inbox = [Receiver.attach(reg, P.transfer_orders(r)) for r in range(2)]
        yield out, inbox
        for x in out + inbox:
            x.detach()


def task(tid, kind, dev, host=(), keys=()):
    return P.TransferTask(tid, kind, list(dev), list(host), list(keys))


def answer(inbox, rank, ok=True, blocks=None):
    task = inbox[rank].get(1)
    n = len(task.device_blocks) if blocks is None else blocks
    return P.TransferDone(task.task_id, rank, ok, n, 100, 0.001, "" if ok else "disk on fire")


def test_task_completes_when_every_rank_answered(ranks):
    out, inbox = ranks
    client = TransferClient(out, rank_timeout=5)
    tid = 7
    client.submit(task(tid, P.STORAGE2GPU, [4, 5, 6], keys=[b"a" * 16, b"b" * 16, b"c" * 16]))
    assert client.on_answer(answer(inbox, 0, blocks=3)) is None
    res = client.on_answer(answer(inbox, 1, blocks=2))
    assert res.ok and res.task.task_id == tid and res.blocks == 2 and res.nbytes == 200
    assert client.inflight == 0
    client.submit(task(8, P.SWAP2CPU, [1], [2]))
    client.on_answer(answer(inbox, 0))
    res = client.on_answer(answer(inbox, 1, ok=False))
    assert not res.ok and "rank 1: disk on fire" in res.error


def test_silent_rank_fails_the_task_by_name(ranks):
    out, inbox = ranks
    client = TransferClient(out, rank_timeout=0.05)
    client.submit(task(1, P.SWAP2GPU, [1, 2], [3, 4]))
    client.on_answer(answer(inbox, 0))
    assert client.expire(now=0) == []
    (res,) = client.expire(now=float("inf"))
    assert not res.ok and "rank(s) [1]" in res.error and client.inflight == 0
    late = answer(inbox, 1)
    assert client.on_answer(late) is None  # an answer after expiry is ignored, not a crash


def test_ownership_detector_refuses_a_wrong_order(ranks):
    out, inbox = ranks
    dev = OwnerTable(np.zeros(8, np.int32), "device")
    host = OwnerTable(np.zeros(8, np.int32), "host")
    client = TransferClient(out, rank_timeout=5, owners=(dev, host))
    dev.owners[[1, 2]] = P.OWNER_CACHE
    client.submit(task(1, P.SWAP2CPU, [1, 2], [0, 1]))  # cached device blocks out to free host blocks: fine
    assert (dev.owners[[1, 2]] == P.OWNER_TRANSFER).all() and (host.owners[[0, 1]] == P.OWNER_TRANSFER).all()
    dev.owners[3] = P.OWNER_WORKER  # the worker is computing into block 3 ...
    with pytest.raises(OwnershipError, match="device block 3 is owned by worker"):
        client.submit(task(2, P.SWAP2CPU, [3], [2]))  # ... so swapping it out is a race
    with pytest.raises(OwnershipError, match="device block 1 is owned by cache-transfer"):
        client.submit(task(3, P.STORAGE2GPU, [1], keys=[b"k" * 16]))  # already being copied
    assert client.inflight == 1  # refused orders were never sent


def test_tasks_carry_the_deadline_the_engine_expires_them_at(ranks):
    """The ranks see the same deadline the engine gives up at (time.monotonic() is one clock
    for the machine), so a rank that gets a task after it never runs it; the engine reports an
    expired task failed exactly once."""
    out, inbox = ranks
    client = TransferClient(out, rank_timeout=3)
    client.submit(task(1, P.SWAP2CPU, [1], [2]))
    sent = [inbox[r].get(1) for r in range(2)]
    assert sent[0].deadline == sent[1].deadline > 0
    assert client.expire(now=np.nextafter(sent[0].deadline, 0)) == []
    (res,) = client.expire(now=sent[0].deadline)
    assert not res.ok and client.expire(now=float("inf")) == []


def test_the_task_the_cache_creates_is_the_task_on_the_wire(ranks):
    """One transfer task: the prefix cache numbers it, the ranks get it under that id, and the
    result applies to the cache by that id (no second numbering to translate)."""
    out, inbox = ranks
    cache = PrefixCache(4, 2, 2)
    keys = BlockHasher(4).update(list(range(12)))
    cache.match("a", keys[:2], 8)
    assert cache.allocate("a", 8) is not None
    cache.update("a", 8)
    cache.release("a")
    cache.match("b", [keys[2]], 5)
    assert cache.allocate("b", 5) is None  # starts a swap-out of a's blocks
    (swap_out,) = cache.take_tasks()
    assert isinstance(swap_out, P.TransferTask) and swap_out.kind is P.TaskKind.SWAP2CPU
    client = TransferClient(out, rank_timeout=5)
    fields = (swap_out.device_blocks, swap_out.host_blocks, swap_out.keys)
    client.submit(swap_out)
    assert [inbox[r].get(1).task_id for r in range(2)] == [swap_out.task_id] * 2
    # the cache's own task is left as it was
    assert all(a is b for a, b in zip(fields, (swap_out.device_blocks, swap_out.host_blocks, swap_out.keys)))
    assert swap_out.deadline == 0.0
    client.on_answer(P.TransferDone(swap_out.task_id, 0, True, 2))
    res = client.on_answer(P.TransferDone(swap_out.task_id, 1, True, 2))
    cache.apply_task_result(res.task.task_id, res.ok, res.blocks)
    assert cache.allocate("b", 5) is not None
    cache.check()
    with pytest.raises(ValueError, match="already in flight"):
        client.submit(task(9, P.SWAP2GPU, [0], [0]))
        client.submit(task(9, P.SWAP2GPU, [0], [0]))


def test_every_task_kind_has_owners_and_a_handler():
    """A task kind is one entry of the kind table; the ownership check and cache-transfer's
    dispatch both cover every entry."""
    from kvrt.workers.cache_transfer import CacheTransfer
    for kind in P.TaskKind:
        dev_from, host_from = TASK_SOURCES[kind]
        assert dev_from and (bool(host_from) == ("host" in (kind.reads, kind.writes)))
        assert kind in CacheTransfer._HANDLERS
        assert P.PROTOCOL.decode(P.PROTOCOL.encode(task(1, kind, [1]))).kind == kind.value
