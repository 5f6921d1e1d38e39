"""One ownership check and one OwnershipError for both halves of a node: the engine refusing a
hand-over and a worker refusing an order fail the same way, with the same words."""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.ipc import protocol as P
from kvrt.ipc.ownership import OwnershipError, check_owners
from kvrt.runtime.engine.ownership import OwnerTable


def test_engine_and_worker_sides_raise_the_same_error_with_the_same_words():
    owners = np.full(4, P.OWNER_WORKER, np.int32)
    with pytest.raises(OwnershipError) as engine_side:
        OwnerTable(owners.copy(), "device").hand_over(np.array([1]), P.OWNER_TRANSFER, {P.OWNER_CACHE}, "task 1")
    with pytest.raises(OwnershipError) as worker_side:
        check_owners(owners, np.array([1]), "device", "task 1", P.OWNER_CACHE)
    for e in (engine_side, worker_side):
        assert "device block 1 is owned by worker, not prefix-cache" in str(e.value)


def test_a_refused_hand_over_changes_no_owner():
    table = OwnerTable(np.array([P.OWNER_CACHE, P.OWNER_WORKER], np.int32), "host")
    with pytest.raises(OwnershipError, match="host block 1 is owned by worker"):
        table.hand_over(np.array([0, 1]), P.OWNER_TRANSFER, {P.OWNER_CACHE}, "task 2")
    assert table.owners.tolist() == [P.OWNER_CACHE, P.OWNER_WORKER]
