"""Layer groups in the prefix cache (runtime/cache/groups.py), case by case: what a hit needs,
which sliding pages a request gives back and in which eviction order, and a decode node's
request that holds pages only for the window it reads. The property machines
(test_prefix_cache_props.py, test_kv_events.py) and the scheduler's liveness test drive the
same code at random."""
from __future__ import annotations

import numpy as np

from kvrt.runtime.cache.keys import BlockHasher, group_key
from kvrt.runtime.cache.prefix_cache import PrefixCache

BS = 2


def run(cache: PrefixCache, rid, tokens: np.ndarray, chunk: int = 4) -> int:
    """Match, compute in chunks and release a request; the blocks its match hit."""
    keys = BlockHasher(BS).update(tokens)
    hit = cache.match(rid, keys, len(tokens)).cached_tokens // BS
    pos = hit * BS
    while pos < len(tokens):
        end = min(len(tokens), pos + chunk)
        assert cache.allocate(rid, end) is not None
        cache.update(rid, end)
        pos = end
        cache.check()
    cache.release(rid)
    cache.check()
    return hit


def test_a_running_request_holds_only_its_window_of_sliding_pages():
    cache = PrefixCache(BS, 200, groups=(4,))
    toks = np.arange(40, dtype=np.int32)
    keys = BlockHasher(BS).update(toks)
    cache.match("a", keys, 40)
    for end in range(4, 41, 4):
        cache.allocate("a", end)
        cache.update("a", end)
        [side] = cache.group_tables("a")
        live = [i for i, b in enumerate(side) if b >= 0]
        assert live == list(range((end - 4 + 1) // BS, end // BS)), (end, side)
        assert cache.device_blocks_held("a") == end // BS + len(live)
    cache.release("a")
    assert cache.check()["device_used"] == 0


def test_a_hit_needs_the_sliding_pages_of_the_window_before_it():
    """A 40-token request keeps its sliding pages of the last two windows before its end at
    their place in the eviction queue and sends the others to its front (the latest released
    first): once another request needs room, a prompt that diverges mid-way finds group 0's
    blocks but not the window before them and hits only up to the last point whose window
    survived; one that diverges near the end hits up to that point."""
    cache = PrefixCache(BS, 40, groups=(4,))
    toks = np.arange(40, dtype=np.int32)
    assert run(cache, "a", toks) == 0
    # 20 full pages, 4 sliding ones kept (blocks 16..19) and 16 sliding ones at the front
    assert cache.block_usage()["device_cached"] == 40
    assert run(cache, "filler", np.arange(1000, 1016, dtype=np.int32)) == 0  # needs 8 + 4: evicts from the front
    mid = np.concatenate([toks[:20], [7, 7, 7]]).astype(np.int32)
    assert cache.lookup(BlockHasher(BS).update(mid)) == 10, "group 0's blocks are all there"
    assert cache.match("mid", BlockHasher(BS).update(mid), len(mid)).cached_tokens == 8  # blocks 2, 3 survived
    cache.release("mid")
    near = np.concatenate([toks[:36], [7, 7, 7]]).astype(np.int32)
    assert cache.match("near", BlockHasher(BS).update(near), len(near)).cached_tokens == 36
    [side] = cache.group_tables("near")
    assert [i for i, b in enumerate(side) if b >= 0] == [16, 17]  # the window before position 36
    cache.release("near")
    cache.check()


def test_a_full_attention_side_group_needs_every_page():
    cache = PrefixCache(BS, 100, groups=(0, 6))
    toks = np.arange(20, dtype=np.int32)
    run(cache, "a", toks)
    keys = BlockHasher(BS).update(toks)
    n = cache._child(int(cache._walk(keys, 3)[2]), group_key(keys[2], 1))  # block 2's page of group 1
    assert n > 0 and cache._group[n] == 1
    assert cache.match("b", keys, 20).cached_tokens == 18
    cache.release("b")


def test_a_decode_nodes_request_holds_pages_only_for_what_it_reads():
    """KV received from a prefill node: a sliding group gets pages only for the window read from
    the first token on, and only those are recorded when it arrives."""
    cache = PrefixCache(BS, 100, groups=(4,))
    toks = np.arange(30, dtype=np.int32)
    keys = BlockHasher(BS).update(toks)
    cache.match("d", keys, 30)
    got = cache.allocate("d", 30, reads_from=30)
    [side] = cache.group_tables("d")
    assert len(got) == 15 and [i for i, b in enumerate(side) if b >= 0] == [13, 14]
    assert cache.device_blocks_held("d") == 17
    cache.update("d", 30)
    cache.release("d")
    assert cache.check()["device_cached"] == 17
    later = np.concatenate([toks, [1, 2, 3]]).astype(np.int32)
    assert cache.match("e", BlockHasher(BS).update(later), len(later)).cached_tokens == 30
    cache.release("e")


def test_storage_holds_every_groups_pages_and_a_read_brings_the_window_or_nothing():
    """Write-through stores the side groups' pages a finished request holds (its last window);
    after a reset a request reads group 0's blocks and the window before their end from
    storage, in one task; a read that comes back short brings nothing (the request's tables are
    as before it, and it computes the whole prompt)."""
    stored: set[bytes] = set()

    def lookup(keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        return n

    def settle(cache, short: bool = False) -> None:
        for t in cache.take_tasks():
            if t.kind.value == "gpu2storage":
                stored.update(t.keys)
            cache.apply_task_result(t.task_id, True, blocks=len(t.keys) - 1 if short and t.kind.value == "storage2gpu"
                                    else None)

    toks = np.arange(30, dtype=np.int32)
    keys = BlockHasher(BS).update(toks)
    for short in (False, True):
        stored.clear()
        cache = PrefixCache(BS, 100, groups=(4,), storage_lookup=lookup, write_through=True)
        run(cache, "a", toks)
        settle(cache)
        assert group_key(keys[14], 1) in stored and group_key(keys[13], 1) in stored
        cache.reset()
        m = cache.match("b", keys, 30)
        assert m.storage_tokens == 28 and not m.ready  # 14 blocks; the last token's block is computed
        [read] = cache.take_tasks()
        assert len(read.keys) == 14 + 2 and read.keys[14:] == [group_key(keys[i], 1) for i in (12, 13)]
        cache.apply_task_result(read.task_id, True, blocks=len(read.keys) - 1 if short else None)
        cache.check()
        [side] = cache.group_tables("b")
        if short:
            assert cache.block_table("b") == [] and side == [] and cache.lookup(keys) == 0
        else:
            assert len(cache.block_table("b")) == 14 and [i for i, b in enumerate(side) if b >= 0] == [12, 13]
            assert cache.lookup(keys) == 14
        assert cache.allocate("b", 30) is not None
        cache.update("b", 30)
        cache.release("b")
        settle(cache)
        cache.check()
