"""The engine's storage index with a shared tier, through the real prefix cache: a lookup is a
read of everything the tree lacks (the answer is the lookup), a miss is counted as one, and a
request's computed blocks are written through although the lookup said "maybe stored"."""
from __future__ import annotations

import numpy as np

from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.cache.prefix_cache import PrefixCache, TaskKind
from kvrt.runtime.cache.storage_index import StorageIndex

BS = 4


def keys_of(tokens: np.ndarray) -> list[bytes]:
    h = BlockHasher(BS)
    h.update(tokens)
    return h.keys


def shared_cache() -> tuple[PrefixCache, StorageIndex]:
    index = StorageIndex(ranks=1, shared=True)
    index.listed(0, [], last=True)
    return PrefixCache(BS, 32, storage_lookup=index.lookup, storage_known=index.known, write_through=True), index


def compute_and_release(c: PrefixCache, rid: str, tokens: np.ndarray, keys: list[bytes]) -> None:
    assert c.allocate(rid, len(tokens)) is not None
    c.update(rid, len(tokens), keys)
    c.release(rid)


def test_a_store_miss_is_a_miss_and_the_blocks_are_written_through():
    c, index = shared_cache()
    tokens = np.arange(1, 18, dtype=np.int32)  # 4 full blocks, 16 of 17 tokens looked up
    keys = keys_of(tokens)
    res = c.match("a", keys, len(tokens))
    assert res.storage_tokens == 16 and len(res.pending_tasks) == 1  # asked: the store knows
    (read,) = c.take_tasks()
    assert read.kind == TaskKind.STORAGE2GPU and read.keys == keys
    out = c.apply_task_result(read.task_id, True, 0)  # none of them was there
    assert out.ready == {"a": 0}
    assert c.metrics.hit_tokens_storage == 0 and c.metrics.hit_requests == 0
    compute_and_release(c, "a", tokens, keys)
    (write,) = c.take_tasks()
    assert write.kind == TaskKind.GPU2STORAGE and write.keys == keys, \
        "a shared store's 'maybe' must not stop the write-through"
    c.apply_task_result(write.task_id, True)
    index.add(write.keys)
    assert index.known(keys) == 4 and index.lookup(keys) == 4
    c.check()


def test_a_partial_store_hit_counts_what_was_read():
    c, _ = shared_cache()
    tokens = np.arange(1, 18, dtype=np.int32)
    keys = keys_of(tokens)
    c.match("a", keys, len(tokens))
    (read,) = c.take_tasks()
    out = c.apply_task_result(read.task_id, True, 2)
    assert out.ready == {"a": 2 * BS}
    assert c.metrics.hit_tokens_storage == 2 * BS and c.metrics.hit_requests == 1
    compute_and_release(c, "a", tokens, keys)
    (write,) = c.take_tasks()
    assert write.keys == keys[2:], "blocks read from the store are not written back"
    c.apply_task_result(write.task_id, True)
    c.check()


def test_add_and_forget_say_which_keys_changed():
    """The engine publishes KV events for exactly these: a shared store's misses are mostly keys
    this node never knew, and a read of a known key is no new block."""
    index = StorageIndex(1, shared=True)
    assert index.add([b"a", b"b"]) == [b"a", b"b"]
    assert index.add([b"b", b"c"]) == [b"c"]
    assert index.forget([b"x", b"a", b"y"]) == [b"a"]
    assert index.known([b"b", b"c"]) == 2 and index.known([b"a"]) == 0


def test_a_reset_forgets_a_local_tier_but_not_a_shared_store():
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    local = StorageIndex(ranks=2)
    local.listed(0, [a, b], last=True)
    assert local.reset(in_flight=[]) == 0  # before the listing was complete: rank 1's batch comes later
    local.listed(1, [a, b], last=True)
    assert local.ready and local.lookup([a, b]) == 0, "a listing under way lists objects from before the reset"
    local.add([a])
    assert local.reset(in_flight=[7]) == 1 and local.lookup([a]) == 0
    assert local.from_before_reset(7) and not local.from_before_reset(7)  # asked once, when its result comes
    assert not local.from_before_reset(8)
    shared = StorageIndex(ranks=1, shared=True)
    shared.listed(0, [], last=True)
    shared.add([c])
    assert shared.reset(in_flight=[3]) == 0 and shared.known([c]) == 1 and shared.keys() == [c]
    assert not shared.from_before_reset(3), "another node's store: what its tasks find is still so"
