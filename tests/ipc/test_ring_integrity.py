"""A ring's consumer trusts nothing in the shared data area: every record header is checked
(length, position tag, wrap markers), a corrupt one breaks the ring for good, and the process
that owns the consumer fails cleanly instead of walking through garbage or replaying old orders."""
import struct

import pytest

from kvrt.ipc import protocol
from kvrt.ipc.errors import ChannelClosed, RingCorrupt
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import HEADER, Consumer, Producer, Ring
from kvrt.ipc.shm import Segment
from tests.nodekit import NodeKit
from tests.workers.test_cache_transfer import assert_all_ok, task

_LEN = struct.Struct("<I")


@pytest.fixture
def ring(node):
    with Registry.create(node) as reg:
        Ring.create(reg, "r", capacity=4096)
        p, c = Producer.attach(reg, "r"), Consumer.attach(reg, "r")
        seg = Segment.attach(c.name)  # a tamperer's view of the same bytes
        yield reg, p, c, seg.mm
        seg.close()
        p.detach()
        c.detach()


def test_corrupt_length_breaks_the_ring_for_both_ends(ring):
    _, p, c, mm = ring
    p.put(b"a" * 10, 1)
    p.put(b"b" * 10, 1)
    _LEN.pack_into(mm, HEADER, 1_000_000)
    with pytest.raises(RingCorrupt, match="length 1000000 exceeds"):
        c.get(1)
    st = c.stats()
    assert st["broken"] and st["protocol_errors"] == 1 and st["records_out"] == 0
    with pytest.raises(RingCorrupt):  # the head did not move: every later read refuses too
        c.try_get()
    with pytest.raises(RingCorrupt):
        c.get_many(8, 1)
    with pytest.raises(ChannelClosed, match="broken"):  # a producer waiting for space is told
        for _ in range(10):
            p.put(b"x" * 1000, 5)


def test_length_past_the_published_tail_is_refused(ring):
    _, p, c, mm = ring
    p.put(b"a" * 100, 1)
    _LEN.pack_into(mm, HEADER, 200)  # within the largest record, beyond what was published
    with pytest.raises(RingCorrupt, match="past what the producer published"):
        c.get(1)


def test_shortened_length_is_caught_at_the_next_header(ring):
    _, p, c, mm = ring
    p.put_many([b"a" * 100, b"b" * 100], 1)
    _LEN.pack_into(mm, HEADER, 40)  # the next "header" now lies inside the first payload
    assert c.get(1) == b"a" * 40
    with pytest.raises(RingCorrupt, match="position tag"):
        c.get(1)


def test_forged_wrap_marker_never_replays_an_old_record(ring):
    _, p, c, mm = ring
    olds = [bytes([65 + i]) * 1000 for i in range(3)]
    for rec in olds:  # one lap of real records, all consumed
        p.put(rec, 1)
        assert c.get(1) == rec
    p.put(b"new order", 1)  # lands at offset 3024; offset 0 still holds the first old record
    _LEN.pack_into(mm, HEADER + 3024, 0xFFFFFFFF)  # forge a wrap marker over its length
    with pytest.raises(RingCorrupt):
        c.get(1)


def test_wraps_the_producer_writes_still_pass(ring):
    _, p, c, _ = ring
    for i in range(200):  # sizes chosen so that records wrap at many different offsets
        rec = bytes([i % 256]) * (37 * i % 1900)
        p.put(rec, 1)
        assert c.get(1) == rec
    p.put_many([b"x" * 1500] * 2, 1)
    assert c.get_many(4, 1) == [b"x" * 1500] * 2


@pytest.mark.e2e
def test_a_flood_of_malformed_orders_is_counted_but_warned_about_sparingly(node, tmp_path):
    with NodeKit.create(node, tmp_path, tp=1) as kit:
        kit.start_transfer()
        for _ in range(500):
            kit.send(b"\xc1 not msgpack")
        assert_all_ok(kit.request(task(1, protocol.SWAP2CPU, [0], [0])), 1, 1)
        out, _ = kit.ends(0)
        assert out.stats()["protocol_errors"] == 500
        warned = kit.log_text(0).count(" skipped: ")
        assert 1 <= warned <= 20, warned


@pytest.mark.e2e
def test_a_child_fed_a_corrupt_record_exits_failed_and_says_why(node, tmp_path):
    with NodeKit.create(node, tmp_path, tp=1) as kit:
        kit.start_transfer()
        prod, _ = kit.ends(0)
        # a record whose header claims a million bytes, published as the producer would
        pos = prod._tail
        struct.pack_into("<II", prod._mm, HEADER + (pos & (prod.capacity - 1)), 1_000_000, (pos >> 3) & 0xFFFFFFFF)
        prod._tail += 64
        prod._publish(1)
        assert kit.procs[0].wait(10) == 1
        log = kit.log_text(0)
        assert "corrupt record" in log and protocol.to_transfer(0) in log, log
