"""Bounded single-producer single-consumer ring of variable-length records in one segment.

Why this shape:
- SPSC needs no read-modify-write on the data path: the producer alone writes `tail`, the
  consumer alone writes `head`; a store-release of the index publishes the bytes before it,
  and the other side's load-acquire sees them. Each side caches the other's index and only
  re-reads it when its cached copy says "full" / "empty".
- head, tail and each side's sleep flag sit on their own cache lines so the two cores do not
  fight over one line.
- Waiting is spin -> sched_yield -> doorbell (an eventcount): a side announces "going to
  sleep", re-checks, and blocks on a semaphore with a timeout slice; the other side rings the
  semaphore only if it sees that announcement, so the fast path never makes a system call.
  `time.sleep` never appears: its ~80 us floor is worse than the whole exchange. An end may
  also spin for a bounded time (`spin_s`) before it yields: where cores are to spare (a GPU
  node's) an answer expected within tens of microseconds (a one-block swap) is then met
  spinning, not by a wake-up through the kernel.
- Liveness is checked only while asleep (once per slice), so a dead or closed peer ends a
  wait with an error naming it, at no cost to the fast path.

Record format: an 8-byte header (4-byte little-endian length, 4-byte position tag) +
payload, padded to 8 bytes. A record that does not fit before the end of the data area leaves
a wrap marker (length 0xFFFFFFFF, tagged the same way) and starts at offset 0. With that rule a
record of at most capacity/2 bytes (header included) always fits into an empty ring, so larger
ones are refused up front instead of waiting forever.

Why the consumer validates every header: the data area is shared memory any process of the
node's user can write, and a consumer that trusted a corrupted length would walk through
garbage as records, or follow a forged wrap marker back to an old record and run it again.
The tag is the record's absolute stream position (in 8-byte units, low 32 bits), which the
producer knows from its tail without any extra shared state, so a replacement producer keeps
it right too; a record from an earlier lap carries an earlier position and can never pass as
the next one. The consumer checks, per record: tag equals its own head position, length at
most the largest record, the record inside the data area and inside what the producer
published, and a wrap marker only where the next record could not have fitted. Any failure
marks the ring broken (both ends' waits then end) and raises RingCorrupt; the head does not
move, so every later read raises again instead of guessing.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from typing import NoReturn, Sequence

from kvrt.ipc._atomic import Region
from kvrt.ipc.doorbell import Doorbell
from kvrt.ipc.errors import ChannelClosed, IpcError, PeerDead, RecordTooLarge, RingCorrupt, WaitTimeout
from kvrt.ipc.registry import ObjectInfo, Registry, pid_alive, process_start_ms
from kvrt.ipc.shm import Segment

MAGIC = int.from_bytes(b"KVRTRNG1", "little")
HEADER = 512
# one cache line each
_MAGIC, _CAP = 0, 8
_TAIL = 64
_HEAD = 128
_CONS_SLEEP = 192
_PROD_SLEEP = 256
_REC_IN, _PROD_PID, _PROD_START = 320, 328, 336
_REC_OUT, _CONS_PID, _CONS_START, _PROTO_ERR = 384, 392, 400, 408
_CLOSED = 448  # 0 open, CLOSED_NORMAL by an end that finished, CLOSED_BROKEN on a corrupt record
CLOSED_NORMAL, CLOSED_BROKEN = 1, 2

_REC = struct.Struct("<II")  # length, position tag
_HDR = _REC.size
_WRAP = 0xFFFFFFFF
_TAG_MASK = 0xFFFFFFFF  # (spelled as a literal on the hot paths: a constant load is cheaper)
WARN_BURST, WARN_EVERY_S = 10, 1.0  # protocol-error warnings per ring: a burst, then one per second
SPINS = 200
YIELDS = 50
SLICE_S = 0.05  # how often a sleeping side checks its peer's liveness


def spin_for(ready, seconds: float) -> bool:
    """Poll `ready()` for up to `seconds` of wall time; whether it became true."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if ready():
            return True
    return False


def _tag(pos: int) -> int:
    """The position tag of the record (or wrap marker) starting at stream position `pos`."""
    return (pos >> 3) & _TAG_MASK


class Ring:
    """Owner handle: creates the segment and doorbells, registered under the node."""

    @staticmethod
    def create(reg: Registry, obj: str, capacity: int = 1 << 20, bell: str | None = None,
               meta: dict | None = None) -> ObjectInfo:
        """Create ring `obj` with `capacity` data bytes (a power of two >= 4 KiB).

        `bell` names an existing doorbell (short name) shared by several rings that one
        consumer polls together (fan-in); by default the ring gets its own. `meta` adds facts
        to its registry entry (a channel's protocol version)."""
        if capacity < 4096 or capacity & (capacity - 1):
            raise ValueError(f"ring {obj}: capacity must be a power of two >= 4096, got {capacity}")
        if bell is None:
            bell = f"{obj}.bell"
            reg.create_doorbell(bell)
        space = f"{obj}.space"
        reg.create_doorbell(space)
        meta = {**(meta or {}), "capacity": capacity, "bell": reg.name_of(bell), "space": reg.name_of(space)}
        seg = reg.create_segment(obj, HEADER + capacity, kind="ring", meta=meta)
        r = Region(seg.mm)
        r.store64(_CAP, capacity)
        r.store64(_MAGIC, MAGIC)
        r.release()
        seg.close()
        return reg.find(obj)


    @staticmethod
    def assign(info: ObjectInfo, producer: int = 0, consumer: int = 0) -> None:
        """Name the process (pid) that will be the producer or consumer of a ring, before it
        attaches: the creator knows who it started, so a process killed before it attached is
        seen dead by its peer's waits (and by a fan-in) like one killed after. The process
        writes the same facts again when it attaches."""
        seg = Segment.attach(info.name)
        r = Region(seg.mm)
        try:
            for pid, pid_off, start_off in ((producer, _PROD_PID, _PROD_START), (consumer, _CONS_PID, _CONS_START)):
                if pid:
                    r.store64(start_off, process_start_ms(pid))
                    r.store64(pid_off, pid)
        finally:
            r.release()
            seg.close()


class _End:
    """What the producer and consumer ends share: the mapping, indices and doorbells."""

    _my_pid_off = _my_start_off = 0
    spin_s = 0.0  # seconds a wait spins by the clock after its first SPINS polls (0: none)

    def __init__(self, info: ObjectInfo):
        self.name = info.name
        self._seg = Segment.attach(info.name)
        self._r = Region(self._seg.mm)
        if self._r.load64(_MAGIC) != MAGIC:
            raise IpcError(f"{self.name} is not an initialised ring")
        self.capacity = self._r.load64(_CAP)
        if self.capacity != info.meta.get("capacity") or HEADER + self.capacity > self._seg.size:
            raise RingCorrupt(f"ring {self.name}: header capacity {self.capacity} does not match the "
                              f"registry ({info.meta.get('capacity')}) or the segment ({self._seg.size} bytes)")
        self._mask = self.capacity - 1
        self.max_record = self.capacity // 2 - _HDR
        self._bell = Doorbell.attach(info.meta["bell"])
        self._space = Doorbell.attach(info.meta["space"])
        pid = os.getpid()
        self._r.store64(self._my_start_off, process_start_ms(pid))
        self._r.store64(self._my_pid_off, pid)

    @classmethod
    def attach(cls, reg: Registry, obj: str):
        info = reg.find(obj)
        if info.kind != "ring":
            raise IpcError(f"{info.name} is a {info.kind}, not a ring")
        return cls(info)

    def _peer_alive(self, pid_off: int, start_off: int) -> bool:
        pid = self._r.load64(pid_off)
        return not pid or pid_alive(pid, self._r.load64(start_off))

    def _peer_gone(self, pid_off: int, start_off: int, peer: str) -> None:
        """Raise if the ring is closed or the peer process is dead."""
        closed = self._r.load64(_CLOSED)
        if closed == CLOSED_BROKEN:
            raise RingCorrupt(f"ring {self.name} is broken (its consumer found a corrupt record)")
        if closed:
            raise ChannelClosed(f"ring {self.name} is closed")
        if not self._peer_alive(pid_off, start_off):
            pid = self._r.load64(pid_off)
            raise PeerDead(f"ring {self.name}: {peer} (pid {pid}) is dead")

    def _wait(self, ready, sleep_off: int, bell: Doorbell, timeout: float, what: str,
              pid_off: int, start_off: int, peer: str) -> None:
        """Wait until `ready()` is true: spin, then yield, then sleep on `bell` in slices."""
        for _ in range(SPINS):
            if ready():
                return
        if self.spin_s > 0 and spin_for(ready, self.spin_s):
            return
        for _ in range(YIELDS):
            os.sched_yield()
            if ready():
                return
        deadline = time.monotonic() + timeout
        r = self._r
        while True:
            r.exchange64(sleep_off, 1)  # announce, then re-check (the fence is in exchange)
            if ready():
                r.store64(sleep_off, 0)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                r.store64(sleep_off, 0)
                raise WaitTimeout(f"ring {self.name}: timed out after {timeout:.3g}s waiting for {what} "
                                  f"from the {peer} (pid {r.load64(pid_off)})")
            bell.wait(min(left, SLICE_S))
            r.store64(sleep_off, 0)
            if ready():
                return
            self._peer_gone(pid_off, start_off, peer)

    def stats(self) -> dict:
        return ring_stats(self._r)

    def close(self) -> None:
        """Mark the ring closed (the peer's waits end with ChannelClosed) and detach."""
        if self._r.load64(_CLOSED) != CLOSED_BROKEN:
            self._r.store64(_CLOSED, CLOSED_NORMAL)
        self._bell.ring()
        self._space.ring()
        self.detach()

    def detach(self) -> None:
        self._bell.close()
        self._space.close()
        self._r.release()
        self._seg.close()


def ring_stats(r: Region) -> dict:
    tail, head = r.load64(_TAIL), r.load64(_HEAD)
    return {
        "capacity": r.load64(_CAP), "depth_bytes": tail - head,
        "records_in": r.load64(_REC_IN), "records_out": r.load64(_REC_OUT),
        "protocol_errors": r.load64(_PROTO_ERR), "closed": bool(r.load64(_CLOSED)),
        "broken": r.load64(_CLOSED) == CLOSED_BROKEN,
        "producer_pid": r.load64(_PROD_PID), "consumer_pid": r.load64(_CONS_PID),
    }


class Producer(_End):
    """The writing end. Resumes from the published tail, so a replacement producer can take
    over a ring whose previous producer died mid-record (unpublished bytes are overwritten)."""

    _my_pid_off, _my_start_off = _PROD_PID, _PROD_START

    def __init__(self, info: ObjectInfo):
        super().__init__(info)
        if self._r.load64(_CLOSED) != CLOSED_BROKEN:  # a broken ring stays broken for good
            self._r.store64(_CLOSED, 0)
        self._tail = self._r.load64(_TAIL)
        self._head_cache = self._r.load64(_HEAD)
        self._count = self._r.load64(_REC_IN)
        self._mm = self._seg.mm

    def _room_for(self, need: int) -> bool:
        return self._room_for_at(self._tail, need)

    def _room_for_at(self, tail: int, need: int) -> bool:
        self._head_cache = self._r.load64(_HEAD)
        return self.capacity - (tail - self._head_cache) >= need

    def _refuse(self, n: int) -> None:
        raise RecordTooLarge(f"ring {self.name}: record of {n} bytes exceeds the maximum "
                             f"{self.max_record} (capacity {self.capacity})")

    def _publish(self, records: int) -> None:
        self._count += records
        r = self._r
        r.store64(_REC_IN, self._count)
        if r.store_fence_load64(_TAIL, self._tail, _CONS_SLEEP) and r.exchange64(_CONS_SLEEP, 0):
            self._bell.ring()

    def _wait_room(self, need: int, timeout: float) -> None:
        self._wait(lambda: self._room_for(need), _PROD_SLEEP, self._space, timeout,
                   f"{need} bytes of space", _CONS_PID, _CONS_START, "consumer")

    def put(self, data: bytes, timeout: float) -> None:
        """Append one record; waits (up to `timeout` s) while the ring is full, never drops."""
        # The hot path, written out in full: each avoided Python call is ~50 ns of ~1 us.
        n = len(data)
        if n > self.max_record:
            self._refuse(n)
        size = (n + 15) & ~7
        tail = self._tail
        off = tail & self._mask
        rest = self.capacity - off
        need = size if size <= rest else rest + size
        if self.capacity - (tail - self._head_cache) < need and not self._room_for(need):
            self._wait_room(need, timeout)
        mm = self._mm
        if size > rest:
            _REC.pack_into(mm, HEADER + off, _WRAP, (tail >> 3) & 0xFFFFFFFF)
            tail += rest
            off = 0
        base = HEADER + off
        _REC.pack_into(mm, base, n, (tail >> 3) & 0xFFFFFFFF)
        mm[base + 8: base + 8 + n] = data
        self._tail = tail = tail + size
        self._count += 1
        r = self._r
        r.store64(_REC_IN, self._count)
        if r.store_fence_load64(_TAIL, tail, _CONS_SLEEP) and r.exchange64(_CONS_SLEEP, 0):
            self._bell.ring()

    def put_many(self, records: Sequence[bytes], timeout: float) -> None:
        """Append records in order, publishing once per run that fits (one fence per batch)."""
        for rec in records:  # refuse oversize before anything is written
            if len(rec) > self.max_record:
                self._refuse(len(rec))
        deadline = time.monotonic() + timeout
        pending = 0
        mm, cap, mask, pack = self._mm, self.capacity, self._mask, _REC.pack_into
        tail = self._tail
        for rec in records:
            n = len(rec)
            size = (n + 15) & ~7
            off = tail & mask
            rest = cap - off
            need = size if size <= rest else rest + size
            if cap - (tail - self._head_cache) < need and not self._room_for_at(tail, need):
                self._tail = tail
                if pending:
                    self._publish(pending)
                    pending = 0
                self._wait_room(need, max(deadline - time.monotonic(), 0.0))
            if size > rest:
                pack(mm, HEADER + off, _WRAP, (tail >> 3) & 0xFFFFFFFF)
                tail += rest
                off = 0
            base = HEADER + off
            pack(mm, base, n, (tail >> 3) & 0xFFFFFFFF)
            mm[base + 8: base + 8 + n] = rec
            tail += size
            pending += 1
        self._tail = tail
        if pending:
            self._publish(pending)


class Consumer(_End):
    """The reading end."""

    _my_pid_off, _my_start_off = _CONS_PID, _CONS_START

    def __init__(self, info: ObjectInfo):
        super().__init__(info)
        self._head = self._r.load64(_HEAD)
        self._tail_cache = self._r.load64(_TAIL)
        self._count = self._r.load64(_REC_OUT)
        self._errors = self._r.load64(_PROTO_ERR)
        self._mm = self._seg.mm
        self._warn_tokens = float(WARN_BURST)
        self._warn_at = time.monotonic()
        self._suppressed = 0

    def _readable(self) -> bool:
        self._tail_cache = self._r.load64(_TAIL)
        return self._tail_cache != self._head

    def _frame(self, head: int, tail: int) -> tuple[int, int, int, int]:
        """Validate the header at stream position `head` (following a wrap marker) against the
        published `tail`: (record start, offset, length, padded size), or raise RingCorrupt.
        The slow path: the hot paths call it only when their inline checks fail."""
        mm, cap = self._mm, self.capacity
        off = head & self._mask
        n, tag = _REC.unpack_from(mm, HEADER + off)
        if tag != _tag(head):
            self._corrupt(head, f"position tag {tag:#x}, expected {_tag(head):#x}")
        start = head
        if n == _WRAP:
            rest = cap - off
            start = head + rest
            if start >= tail:
                self._corrupt(head, f"wrap marker at offset {off} but nothing published after it (tail {tail})")
            n, tag = _REC.unpack_from(mm, HEADER)
            if tag != _tag(start):
                self._corrupt(start, f"position tag {tag:#x} after a wrap marker, expected {_tag(start):#x}")
            if n <= self.max_record and (n + 15) & ~7 <= rest:
                self._corrupt(head, f"wrap marker at offset {off} although the next record "
                                    f"({n} bytes) fits in the {rest} bytes left")
            off = 0
        size = (n + 15) & ~7
        if n > self.max_record:
            self._corrupt(start, f"length {n} exceeds the largest record {self.max_record}")
        if off + size > cap:
            self._corrupt(start, f"record of {size} bytes at offset {off} runs past the data area ({cap} bytes)")
        if start + size > tail:
            self._corrupt(start, f"record of {size} bytes runs past what the producer published (tail {tail})")
        return start, off, n, size

    def _corrupt(self, pos: int, why: str) -> NoReturn:
        """Mark the ring broken (the producer's waits end too) and raise; the head stays put."""
        r = self._r
        r.store64(_CLOSED, CLOSED_BROKEN)
        self._errors += 1
        r.store64(_PROTO_ERR, self._errors)
        self._space.ring()
        raise RingCorrupt(f"ring {self.name}: corrupt record at stream position {pos}: {why}; "
                          f"ring marked broken (producer pid {r.load64(_PROD_PID)})")

    def _read(self) -> bytes:
        head = self._head
        off = head & self._mask
        n, tag = _REC.unpack_from(self._mm, HEADER + off)
        size = (n + 15) & ~7
        if (n > self.max_record or tag != (head >> 3) & 0xFFFFFFFF or head + size > self._tail_cache
                or off + size > self.capacity):
            head, off, n, size = self._frame(head, self._tail_cache)
        base = HEADER + off + 8
        data = self._mm[base: base + n]
        self._head = head + size
        return data

    def _release(self, records: int) -> None:
        self._count += records
        r = self._r
        r.store64(_REC_OUT, self._count)
        if r.store_fence_load64(_HEAD, self._head, _PROD_SLEEP) and r.exchange64(_PROD_SLEEP, 0):
            self._space.ring()

    def wait_readable(self, timeout: float) -> None:
        if self._head == self._tail_cache and not self._readable():
            self._wait(self._readable, _CONS_SLEEP, self._bell, timeout, "a record",
                       _PROD_PID, _PROD_START, "producer")

    def get(self, timeout: float) -> bytes:
        """Take one record; waits up to `timeout` s. Raises WaitTimeout, PeerDead, ChannelClosed,
        and RingCorrupt (a ChannelClosed) when the record's header fails validation."""
        head = self._head
        if head == self._tail_cache and not self._readable():
            self.wait_readable(timeout)
        mm = self._mm
        off = head & self._mask
        n, tag = _REC.unpack_from(mm, HEADER + off)
        size = (n + 15) & ~7
        if (n > self.max_record or tag != (head >> 3) & 0xFFFFFFFF or head + size > self._tail_cache
                or off + size > self.capacity):
            head, off, n, size = self._frame(head, self._tail_cache)
        base = HEADER + off + 8
        data = mm[base: base + n]
        self._head = head = head + size
        self._count += 1
        r = self._r
        r.store64(_REC_OUT, self._count)
        if r.store_fence_load64(_HEAD, head, _PROD_SLEEP) and r.exchange64(_PROD_SLEEP, 0):
            self._space.ring()
        return data

    def try_get(self) -> bytes | None:
        """One record if one is there, else None; never waits."""
        if self._head == self._tail_cache and not self._readable():
            return None
        data = self._read()
        self._release(1)
        return data

    def get_many(self, max_records: int, timeout: float) -> list[bytes]:
        """Wait for at least one record, then take up to `max_records` (one release per batch).
        A corrupt header raises RingCorrupt; records before it in the batch are released first
        and are lost to the caller, as is everything after the corruption."""
        if self._head == self._tail_cache and not self._readable():
            self.wait_readable(timeout)
        out = []
        append = out.append
        mm, mask, cap, unpack, maxrec = self._mm, self._mask, self.capacity, _REC.unpack_from, self.max_record
        head, tail = self._head, self._tail_cache
        try:
            while len(out) < max_records:
                if head == tail:
                    tail = self._tail_cache = self._r.load64(_TAIL)
                    if head == tail:
                        break
                off = head & mask
                n, tag = unpack(mm, HEADER + off)
                size = (n + 15) & ~7
                if n > maxrec or tag != (head >> 3) & 0xFFFFFFFF or head + size > tail or off + size > cap:
                    head, off, n, size = self._frame(head, tail)
                base = HEADER + off + 8
                append(mm[base: base + n])
                head += size
        finally:
            self._head = head
            self._release(len(out))
        return out

    def pending(self) -> bool:
        """True if records are waiting (without taking one)."""
        return self._head != self._tail_cache or self._readable()

    @property
    def closed(self) -> bool:
        return bool(self._r.load64(_CLOSED))

    def producer_alive(self) -> bool:
        """False once an attached producer died; True while none ever attached."""
        return self._peer_alive(_PROD_PID, _PROD_START)

    @property
    def producer_pid(self) -> int:
        return self._r.load64(_PROD_PID)

    def set_sleeping(self, on: bool) -> None:
        """Eventcount announcement, for waiters (FanIn) that sleep on a shared doorbell."""
        if on:
            self._r.exchange64(_CONS_SLEEP, 1)
        else:
            self._r.store64(_CONS_SLEEP, 0)

    @property
    def doorbell(self) -> Doorbell:
        return self._bell

    def count_protocol_error(self) -> None:
        """Record that a message from this ring could not be decoded (shown by `kvrt status`)."""
        self._errors += 1
        self._r.store64(_PROTO_ERR, self._errors)

    def report_protocol_error(self, logger: logging.Logger, err: Exception) -> None:
        """Count an undecodable message and warn about it: the first WARN_BURST freely, then
        at most one per WARN_EVERY_S per ring (a token bucket). A producer gone wrong can send
        bad messages as fast as the ring carries them, and a warning each would fill the disk
        with the same line."""
        self.count_protocol_error()
        now = time.monotonic()
        self._warn_tokens = min(WARN_BURST, self._warn_tokens + (now - self._warn_at) / WARN_EVERY_S)
        self._warn_at = now
        if self._warn_tokens < 1.0:
            self._suppressed += 1
            return
        self._warn_tokens -= 1.0
        more = f" ({self._suppressed} more not shown)" if self._suppressed else ""
        logger.warning("bad message on %s skipped: %s%s", self.name, err, more)
        self._suppressed = 0


def peek_stats(info: ObjectInfo) -> dict:
    """A ring's counters read from outside (status readers): neither end is touched."""
    seg = Segment.attach(info.name)
    r = Region(seg.mm)
    try:
        return ring_stats(r)
    finally:
        r.release()
        seg.close()
