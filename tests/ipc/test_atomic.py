import mmap
import multiprocessing as mp

import numpy as np
import pytest

from kvrt.ipc._atomic import Region, fence


@pytest.fixture
def region():
    m = mmap.mmap(-1, 4096)
    r = Region(m)
    yield r
    r.release()
    m.close()


def test_load_store_exchange_cas_fetch_add(region):
    region.store64(8, -5)
    assert region.load64(8) == -5
    assert region.exchange64(8, 7) == -5
    assert region.cas64(8, 7, 9) is True
    assert region.cas64(8, 7, 11) is False
    assert region.load64(8) == 9
    assert region.fetch_add64(8, 3) == 9
    assert region.load64(8) == 12
    region.store32(4, 2**31 - 1)
    assert region.fetch_add32(4, 1) == 2**31 - 1
    assert region.load32(4) == -(2**31)  # wraps like C int32
    assert region.exchange32(4, 1) == -(2**31)
    assert region.cas32(4, 1, 2) and region.load32(4) == 2
    region.store64(16, 2**63 - 1)
    assert region.load64(16) == 2**63 - 1
    fence()


@pytest.mark.parametrize("call", [
    lambda r: r.load64(4),          # misaligned
    lambda r: r.load32(2),
    lambda r: r.load64(4096),       # past the end
    lambda r: r.load64(4090),       # straddles the end
    lambda r: r.store64(-8, 1),     # negative
    lambda r: r.store32(0, 2**31),  # does not fit
    lambda r: r.load64(),           # wrong arity
    lambda r: r.cas64(0, 1),
    lambda r: r.load64("x"),
])
def test_bad_arguments_raise_not_crash(region, call):
    with pytest.raises((IndexError, ValueError, OverflowError, TypeError)):
        call(region)


def test_released_region_raises(region):
    region.release()
    with pytest.raises(ValueError):
        region.load64(0)


def test_readonly_buffer_refused():
    with pytest.raises(BufferError):
        Region(b"12345678")


def test_matches_numpy_view(region):
    buf = np.zeros(8, dtype=np.int64)
    r = Region(buf)
    r.store64(24, 42)
    assert buf[3] == 42
    r.release()


def _adder(m, n):
    r = Region(m)
    for _ in range(n):
        r.fetch_add64(0, 1)
        r.fetch_add32(8, 1)


@pytest.mark.e2e
def test_fetch_add_is_atomic_across_processes():
    m = mmap.mmap(-1, 4096)  # anonymous shared mapping survives fork
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_adder, args=(m, 20000)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    r = Region(m)
    assert r.load64(0) == 60000
    assert r.load32(8) == 60000
    r.release()
