"""The engine side of cache-transfer tasks: complete on all ranks, fail on a silent rank, and
the ownership race detector refusing a wrong hand-over."""
import numpy as np
import pytest

from ipc import protocol as P
from ipc.registry import Registry
from ipc.ring import Consumer, Producer, Ring
from runtime.ownership import OwnerTable, OwnershipError
from runtime.transfer import TransferClient


@pytest.fixture
def ranks(node):
    with Registry.create(node) as reg:
        for r in range(2):
            Ring.create(reg, f"task.{r}", capacity=1 << 14)
        out = [Producer.attach(reg, f"task.{r}") for r in range(2)]
        inbox = [Consumer.attach(reg, f"task.{r}") for r in range(2)]
        yield out, inbox
        for x in out + inbox:
            x.detach()


def answer(inbox, rank, ok=True, blocks=None):
    task = P.PROTOCOL.decode(inbox[rank].get(1))
    n = len(task.device_blocks) if blocks is None else blocks
    return P.TransferDone(task.task_id, rank, ok, n, 100, 0.001, "" if ok else "disk on fire")


def test_task_completes_when_every_rank_answered(ranks):
    out, inbox = ranks
    client = TransferClient(out, rank_timeout=5)
    tid = client.submit(P.STORAGE2GPU, [4, 5, 6], keys=[b"a" * 16, b"b" * 16, b"c" * 16])
    assert client.on_answer(answer(inbox, 0, blocks=3)) is None
    res = client.on_answer(answer(inbox, 1, blocks=2))
    assert res.ok and res.task.task_id == tid and res.blocks == 2 and res.nbytes == 200
    assert client.inflight == 0
    client.submit(P.SWAP2CPU, [1], [2])
    client.on_answer(answer(inbox, 0))
    res = client.on_answer(answer(inbox, 1, ok=False))
    assert not res.ok and "rank 1: disk on fire" in res.error


def test_silent_rank_fails_the_task_by_name(ranks):
    out, inbox = ranks
    client = TransferClient(out, rank_timeout=0.05)
    client.submit(P.SWAP2GPU, [1, 2], [3, 4])
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
    client.submit(P.SWAP2CPU, [1, 2], [0, 1])  # cached device blocks out to free host blocks: fine
    assert dev.owned_by([1, 2], P.OWNER_TRANSFER) and host.owned_by([0, 1], P.OWNER_TRANSFER)
    dev.owners[3] = P.OWNER_WORKER  # the worker is computing into block 3 ...
    with pytest.raises(OwnershipError, match="device block 3 is owned by worker"):
        client.submit(P.SWAP2CPU, [3], [2])  # ... so swapping it out is a race
    with pytest.raises(OwnershipError, match="device block 1 is owned by cache-transfer"):
        client.submit(P.STORAGE2GPU, [1], keys=[b"k" * 16])  # already being copied
    assert client.inflight == 1  # refused orders were never sent


def test_tasks_carry_the_deadline_the_engine_expires_them_at(ranks):
    """The ranks see the same deadline the engine gives up at (time.monotonic() is one clock
    for the machine), so a rank that gets a task after it never runs it; the engine reports an
    expired task failed exactly once."""
    out, inbox = ranks
    client = TransferClient(out, rank_timeout=3)
    client.submit(P.SWAP2CPU, [1], [2])
    sent = [P.PROTOCOL.decode(inbox[r].get(1)) for r in range(2)]
    assert sent[0].deadline == sent[1].deadline > 0
    assert client.expire(now=np.nextafter(sent[0].deadline, 0)) == []
    (res,) = client.expire(now=sent[0].deadline)
    assert not res.ok and client.expire(now=float("inf")) == []
