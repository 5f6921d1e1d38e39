"""The use-count sketch: its C updates (runtime/cache/_cache_core.c) count exactly as its numpy
reference (tests/runtime/cache/cache_reference.py) does, shared slots, saturation and halving included; keys
that are not 16-byte block keys are refused."""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.runtime.cache import _cache_core, use_sketch
from kvrt.runtime.cache.use_sketch import UseSketch
from tests.runtime.cache import cache_reference as ref


def _reference(monkeypatch, timed: bool = False) -> UseSketch:
    """A sketch that runs the numpy reference (in place of the C functions, for every sketch
    from now on)."""
    monkeypatch.setattr(use_sketch, "_add_c", ref.sketch_add)
    monkeypatch.setattr(use_sketch, "_count_c", ref.sketch_count)
    return UseSketch(100, timed=timed)


def test_c_updates_equal_the_numpy_reference(monkeypatch):
    rng = np.random.default_rng(7)
    fast = UseSketch(100)
    raw = rng.bytes(16 * 600)
    pool = [raw[i:i + 16] for i in range(0, len(raw), 16)]
    # a key sharing its first row's slot with another (same low 32 bits), and one sharing both
    pool.append(pool[0][:4] + b"\x01\x02\x03\x04" + pool[0][8:])
    pool.append(pool[1][:8] + bytes(8))
    batches = [[pool[int(j)] for j in rng.choice(len(pool), size=int(rng.integers(0, 200)), replace=False)]
               for _ in range(500)]
    batches.append([pool[0], pool[-2], pool[1], pool[-1]])
    batches += [[pool[3]]] * 300  # saturates at 255
    rows = []
    for keys in batches:
        fast.add(keys)
        rows.append(fast._rows.copy())
    counted = batches[:50] + [[pool[3]], []]
    counts = [fast.count(keys) for keys in counted]
    slow = _reference(monkeypatch)  # from here on, every sketch runs the numpy code
    for keys, want in zip(batches, rows):
        slow.add(keys)
        assert np.array_equal(want, slow._rows)
    assert fast._added == slow._added
    for keys, got in zip(counted, counts):
        assert got.dtype == np.int32 and np.array_equal(got, slow.count(keys))


def test_c_stamps_equal_the_numpy_reference(monkeypatch):
    """The timed sketch's ages and stamps, with keys that share a slot (an age is the older of
    a key's two stamps) and keys never seen (-1)."""
    rng = np.random.default_rng(11)
    raw = rng.bytes(16 * 400)
    pool = [raw[i:i + 16] for i in range(0, len(raw), 16)]
    pool.append(pool[0][:4] + b"\x09\x08\x07\x06" + pool[0][8:])  # shares pool[0]'s first slot
    batches = [[pool[int(j)] for j in rng.choice(len(pool), size=int(rng.integers(0, 60)), replace=False)]
               for _ in range(400)]
    fast = UseSketch(100, timed=True)
    got = [fast.add(keys) for keys in batches]
    slow = _reference(monkeypatch, timed=True)
    for keys, ages in zip(batches, got):
        want = slow.add(keys)
        assert ages.dtype == np.int64 and np.array_equal(ages, want)
    assert np.array_equal(fast._stamps, slow._stamps) and np.array_equal(fast._rows, slow._rows)
    assert any((a > 0).any() for a in got) and any((a == -1).any() for a in got)


@pytest.mark.parametrize("timed", [False, True])
def test_keys_that_are_not_16_bytes_are_refused_before_anything_changes(timed):
    keys = [bytes(16), b"short", b"a much longer key than sixteen bytes"]
    r0 = np.zeros(1 << 16, dtype=np.uint8)
    assert _cache_core.sketch_add(r0, r0.copy(), keys, (1 << 16) - 1) is False
    assert not r0.any()  # nothing added
    sketch = UseSketch(100, timed=timed)
    sketch.add([bytes([7]) * 16])
    before = (sketch._rows.copy(), None if sketch._stamps is None else sketch._stamps.copy(), sketch._now)
    for call in (lambda: sketch.add(keys), lambda: sketch.count(keys),
                 lambda: sketch.raise_hits(keys, np.zeros(8, dtype=np.int32), np.arange(3, dtype=np.int32), None)):
        with pytest.raises(ValueError, match="16 bytes"):
            call()
    assert np.array_equal(sketch._rows, before[0]) and sketch._now == before[2]
    assert sketch._stamps is None or np.array_equal(sketch._stamps, before[1])


def test_raising_hits_in_c_equals_counting():
    """`raise_hits` (one C call) gives recorded nodes exactly what `count` and numpy give them:
    count - 1, capped by the parent's and by every earlier key's, at least 0, never lowered."""
    rng = np.random.default_rng(11)
    sketch = UseSketch(100)
    raw = rng.bytes(16 * 300)
    pool = [raw[i:i + 16] for i in range(0, len(raw), 16)]
    for _ in range(400):
        sketch.add([pool[int(j)] for j in rng.choice(300, size=40, replace=False)])
    cases = []
    for _ in range(200):
        keys = [pool[int(j)] for j in rng.choice(300, size=int(rng.integers(1, 30)), replace=False)]
        nodes = rng.choice(500, size=len(keys), replace=False).astype(np.int32)
        hits = rng.integers(0, 4, 500).astype(np.int32)
        cap = None if rng.random() < 0.3 else int(rng.integers(0, 6))
        cases.append((keys, nodes, hits, cap))
    for keys, nodes, hits, cap in cases:
        want = hits.copy()
        earlier = sketch.count(keys) - 1
        if cap is not None:
            earlier[0] = min(earlier[0], cap)
        want[nodes] = np.maximum(want[nodes], np.maximum(np.minimum.accumulate(earlier), 0))
        got = hits.copy()
        sketch.raise_hits(keys, got, nodes, cap)
        assert np.array_equal(got, want)
    for keys, nodes, hits, cap in cases:  # the reference the cache's comparison runs against
        want = hits.copy()
        assert ref.sketch_raise(sketch._r0, sketch._r1, keys, sketch._int_mask, want, nodes, cap)
        got = hits.copy()
        sketch.raise_hits(keys, got, nodes, cap)
        assert np.array_equal(got, want)
