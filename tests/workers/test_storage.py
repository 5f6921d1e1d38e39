import os

import numpy as np
import pytest

from kvrt.workers.storage.base import FileStorage, StorageError
from kvrt.workers.storage.factory import open_storage

KEY = bytes(range(16))


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((2, 2, 4, 8), dtype=np.float32)


def test_round_trip_per_rank_and_layout(tmp_path):
    s0, s1 = FileStorage(str(tmp_path), 0), FileStorage(str(tmp_path), 1)
    a, b = block(0), block(1)
    assert not s0.contains(KEY)
    s0.put(KEY, a)
    s1.put(KEY, b)
    assert s0.path(KEY) == os.path.join(str(tmp_path), "00", KEY.hex() + ".r0.kvb")
    assert s0.contains(KEY) and s1.contains(KEY)
    out = np.zeros_like(a)
    assert s0.get(KEY, out) and np.array_equal(out, a)
    assert s1.get(KEY, out) and np.array_equal(out, b)
    s0.put(KEY, b)  # overwrite is atomic: no temporary file is left behind
    assert s0.get(KEY, out) and np.array_equal(out, b)
    assert sorted(os.listdir(tmp_path / "00")) == [KEY.hex() + ".r0.kvb", KEY.hex() + ".r1.kvb"]


@pytest.mark.parametrize("damage", ["missing", "truncated", "empty", "flipped", "magic", "longer", "renamed"])
def test_damaged_objects_are_misses_not_crashes(tmp_path, damage):
    s = FileStorage(str(tmp_path), 0)
    a = block(2)
    s.put(KEY, a)
    path = s.path(KEY)
    key = KEY
    data = open(path, "rb").read()
    if damage == "missing":
        os.unlink(path)
    elif damage == "truncated":
        open(path, "wb").write(data[:-100])
    elif damage == "empty":
        open(path, "wb").close()
    elif damage == "flipped":
        open(path, "wb").write(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # (a payload byte)
    elif damage == "magic":
        open(path, "wb").write(b"X" + data[1:])
    elif damage == "longer":
        open(path, "wb").write(data + b"\0")
    elif damage == "renamed":  # another key's intact object under this key's name
        key = bytes(16)
        os.makedirs(os.path.dirname(s.path(key)), exist_ok=True)
        os.rename(path, s.path(key))
    out = np.ones_like(a)
    assert s.get(key, out) is False


def test_a_block_of_another_size_is_a_miss(tmp_path):
    s = FileStorage(str(tmp_path), 0)
    s.put(KEY, block(3))
    assert not s.get(KEY, np.zeros((2, 2, 4, 4), np.float32))


def test_write_failure_raises_storage_error(tmp_path):
    s = FileStorage(str(tmp_path), 0)
    open(os.path.dirname(s.path(KEY)), "w").close()  # a file where the shard directory goes
    with pytest.raises(StorageError, match="storage write"):
        s.put(KEY, block(4))
    assert not s.get(KEY, block(4))


def test_open_storage_uri(tmp_path):
    assert open_storage("", 0) is None
    s = open_storage(f"file:{tmp_path}/kv", 3)
    assert isinstance(s, FileStorage) and s.rank == 3 and s.directory == f"{tmp_path}/kv"
    for bad in ("mooncake://x", "file:", "ftp:/x", "file:/x?max_bytes=lots"):
        with pytest.raises(ValueError, match="storage|size"):
            open_storage(bad, 0)


def test_directories_and_objects_are_private_whatever_the_umask(tmp_path):
    """KV blocks are the prompts in another form: 0700 directories (the storage root and every
    missing parent included) and 0600 objects, even under a permissive umask."""
    old = os.umask(0o000)
    try:
        root = tmp_path / "new" / "store"
        s = FileStorage(str(root), 0)
        s.put(KEY, block(3))
    finally:
        os.umask(old)
    for d in (tmp_path / "new", root, root / "00"):
        assert os.stat(d).st_mode & 0o777 == 0o700, d
    assert os.stat(s.path(KEY)).st_mode & 0o777 == 0o600
    old = os.umask(0o277)  # a umask that would even take the owner's write bit
    try:
        FileStorage(str(root), 1).put(KEY, block(4))
    finally:
        os.umask(old)
    assert os.stat(FileStorage(str(root), 1).path(KEY)).st_mode & 0o777 == 0o600


def _object_bytes(s: FileStorage) -> int:
    return sum(os.path.getsize(s.path(k)) for k in s.keys())


def test_a_capped_tier_evicts_the_least_recently_used_objects(tmp_path):
    size = FileStorage(str(tmp_path / "probe"), 0)
    size.put(KEY, block(0))
    one = os.path.getsize(size.path(KEY))
    s = FileStorage(str(tmp_path / "kv"), 0, max_bytes=4 * one)
    keys = [bytes([i]) * 16 for i in range(6)]
    for i, key in enumerate(keys[:4]):
        s.put(key, block(i))
    assert s.get(keys[0], np.zeros_like(block(0)))  # a read makes it the most recently used
    s.put(keys[4], block(4))  # over the cap: down to 7/8 of it, least recently used first
    assert sorted(s.keys()) == sorted([keys[0], keys[2], keys[3], keys[4]]) or \
        sorted(s.keys()) == sorted([keys[0], keys[3], keys[4]])
    assert keys[1] not in set(s.keys()) and _object_bytes(s) <= 4 * one
    # a restart learns the order from the files' times (the clock ticks coarser than these
    # writes: set them) and a lower cap trims at once
    for age, key in enumerate(reversed(sorted(s.keys(), key=[keys[3], keys[2], keys[0], keys[4]].index))):
        os.utime(s.path(key), ns=(10**18 - age * 10**9,) * 2)
    again = FileStorage(str(tmp_path / "kv"), 0, max_bytes=2 * one)
    assert set(again.keys()) <= {keys[0], keys[4]} and _object_bytes(again) <= 2 * one
    out = np.zeros_like(block(0))
    assert again.get(keys[4], out) and np.array_equal(out, block(4))
    other_rank = FileStorage(str(tmp_path / "kv"), 1, max_bytes=one)
    other_rank.put(keys[5], block(5))
    assert set(again.keys()) <= {keys[0], keys[4]} and len(list(again.keys())) >= 1, \
        "a rank evicts only its own objects"


def test_open_storage_splits_the_cap_among_ranks(tmp_path):
    s = open_storage(f"file:{tmp_path}/kv?max_bytes=1M", 1, tp=4)
    assert isinstance(s, FileStorage) and s.max_bytes == (1 << 20) // 4
    assert open_storage(f"file:{tmp_path}/kv", 0).max_bytes == 0


def test_a_batch_read_writes_nothing_past_its_deadline(tmp_path):
    """The cache-transfer task that asked has expired: the engine took its blocks back."""
    import time

    s = FileStorage(str(tmp_path), 0)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        s.put(key, block(i))
    outs = [np.zeros_like(block(0)) for _ in keys]
    assert s.get_many(keys, outs, deadline=time.monotonic() + 60) == 3
    outs = [np.zeros_like(block(0)) for _ in keys]
    assert s.get_many(keys, outs, deadline=time.monotonic() - 1) == 0 and not any(o.any() for o in outs)
