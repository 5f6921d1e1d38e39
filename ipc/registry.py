"""The per-node registry: the one place that lists every shared object of a node.

Why it exists: status readers and cleaners must never guess names, and a crashed node must
be reclaimable by someone else. So the owner (the launcher) *registers an object before it
creates it* and unlinks the registry *last*; the registry is therefore always a superset of
what exists in /dev/shm, and reclaiming a dead node is "unlink everything listed".

Layout of `kvrt.<node>.registry`: a 4 KiB header (magic, owner pid and start time, entry
count published with store-release), then fixed 512-byte slots, each a length-prefixed
msgpack map. Only the owner writes; readers load the count with acquire and read slots.
"""
from __future__ import annotations

import os
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import psutil

from ._atomic import Region
from .doorbell import Doorbell, unlink_doorbell
from .errors import IpcError, NodeLive
from .shm import (PREFIX, SHM_DIR, Segment, object_name, segment_exists, unlink_segment,
                  validate_node_name)

MAGIC = int.from_bytes(b"KVRTREG1", "little")
VERSION = 1
HEADER = 4096
SLOT = 512
MAX_ENTRIES = 1024
_OFF_MAGIC, _OFF_VERSION, _OFF_PID, _OFF_START, _OFF_COUNT, _OFF_CREATED = 0, 8, 16, 24, 32, 40
_LEN = struct.Struct("<I")


@dataclass
class ObjectInfo:
    """One registered object. `meta` carries kind-specific facts (ring capacity, role, rank)."""

    name: str
    kind: str  # "segment", "signal", "ring", "pool", "doorbell"
    dtype: str = ""
    shape: tuple = ()
    creator_pid: int = 0
    created: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


def process_start_ms(pid: int) -> int:
    """Start time of a process in ms, or 0 if it does not exist; guards against pid reuse."""
    try:
        return int(round(psutil.Process(pid).create_time() * 1000))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def pid_alive(pid: int, start_ms: int = 0) -> bool:
    """True if `pid` runs and is not a zombie (and, if given, started at `start_ms`)."""
    if pid <= 0:
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return not start_ms or int(round(p.create_time() * 1000)) == start_ms
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


class Registry:
    """A node's registry, opened as its owner (`create`) or as a reader (`attach`)."""

    def __init__(self, node: str, seg: Segment):
        self.node = node
        self._seg = seg
        self._region = Region(seg.mm)
        self.owner = seg.owner

    # ---- life cycle -------------------------------------------------------------
    @classmethod
    def create(cls, node: str) -> "Registry":
        """Become the owner of `node`. Refuses a live node; reclaims a dead one first."""
        validate_node_name(node)
        name = object_name(node, "registry")
        try:
            seg = Segment.create(name, HEADER + SLOT * MAX_ENTRIES)
        except IpcError:
            reclaim(node)  # raises NodeLive if its owner is alive
            seg = Segment.create(name, HEADER + SLOT * MAX_ENTRIES)
        reg = cls(node, seg)
        r = reg._region
        pid = os.getpid()
        r.store64(_OFF_VERSION, VERSION)
        r.store64(_OFF_PID, pid)
        r.store64(_OFF_START, process_start_ms(pid))
        r.store64(_OFF_CREATED, time.time_ns())
        r.store64(_OFF_COUNT, 0)
        r.store64(_OFF_MAGIC, MAGIC)
        return reg

    @classmethod
    def attach(cls, node: str) -> "Registry":
        validate_node_name(node)
        seg = Segment.attach(object_name(node, "registry"))
        reg = cls(node, seg)
        if reg._region.load64(_OFF_MAGIC) != MAGIC:
            reg.close()
            raise IpcError(f"node {node}: registry is not initialised (node starting or crashed mid-start)")
        return reg

    def close(self) -> None:
        self._region.release()
        self._seg.close()

    def unlink_all(self) -> list[str]:
        """Owner only: unlink every registered object, then the registry itself (last)."""
        removed = _unlink_entries(self.entries())
        self._seg.unlink()
        self.close()
        return removed + [self._seg.name]

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.owner:
            self.unlink_all()
        else:
            self.close()

    # ---- facts ------------------------------------------------------------------
    @property
    def owner_pid(self) -> int:
        return self._region.load64(_OFF_PID)

    @property
    def owner_start_ms(self) -> int:
        return self._region.load64(_OFF_START)

    @property
    def created_ns(self) -> int:
        return self._region.load64(_OFF_CREATED)

    def owner_alive(self) -> bool:
        return pid_alive(self.owner_pid, self._region.load64(_OFF_START))

    def name_of(self, obj: str) -> str:
        return object_name(self.node, obj)

    # ---- entries ----------------------------------------------------------------
    def add(self, info: ObjectInfo) -> None:
        """Owner only: append one entry and publish it with a store-release of the count."""
        if not self.owner:
            raise IpcError(f"node {self.node}: only the registry owner may register objects")
        n = self._region.load64(_OFF_COUNT)
        if n >= MAX_ENTRIES:
            raise IpcError(f"node {self.node}: registry full ({MAX_ENTRIES} objects)")
        d = asdict(info)
        d["shape"] = list(info.shape)
        data = msgpack.packb(d)
        if len(data) + _LEN.size > SLOT:
            raise IpcError(f"registry entry for {info.name} too large ({len(data)} bytes)")
        off = HEADER + n * SLOT
        _LEN.pack_into(self._seg.mm, off, len(data))
        self._seg.mm[off + _LEN.size : off + _LEN.size + len(data)] = data
        self._region.store64(_OFF_COUNT, n + 1)

    def entries(self) -> list[ObjectInfo]:
        n = self._region.load64(_OFF_COUNT)
        out = []
        for i in range(min(n, MAX_ENTRIES)):
            off = HEADER + i * SLOT
            (ln,) = _LEN.unpack_from(self._seg.mm, off)
            d = msgpack.unpackb(bytes(self._seg.mm[off + _LEN.size : off + _LEN.size + ln]))
            d["shape"] = tuple(d["shape"])
            out.append(ObjectInfo(**d))
        return out

    def find(self, obj: str) -> ObjectInfo:
        """The entry of object `obj` (short name, without `kvrt.<node>.`)."""
        full = self.name_of(obj)
        for e in self.entries():
            if e.name == full:
                return e
        raise IpcError(f"node {self.node}: no object {obj!r} in the registry")

    # ---- creating registered objects ----------------------------------------------
    def create_segment(self, obj: str, size: int, kind: str = "segment", dtype: str = "",
                       shape: tuple = (), meta: dict | None = None, prefault: bool = False) -> Segment:
        name = self.name_of(obj)
        self.add(ObjectInfo(name, kind, dtype, tuple(shape), os.getpid(), time.time(), meta or {}))
        return Segment.create(name, size, prefault=prefault)

    def create_doorbell(self, obj: str) -> Doorbell:
        name = self.name_of(obj)
        self.add(ObjectInfo(name, "doorbell", creator_pid=os.getpid(), created=time.time()))
        return Doorbell.create(name)


def _unlink_entries(entries: list[ObjectInfo]) -> list[str]:
    removed = []
    for e in reversed(entries):
        gone = unlink_doorbell(e.name) if e.kind == "doorbell" else unlink_segment(e.name)
        if gone:
            removed.append(e.name)
    return removed


def list_nodes() -> list[str]:
    """Names of every node with a registry in /dev/shm, live or dead."""
    suffix = ".registry"
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n[len(PREFIX) + 1 : -len(suffix)] for n in names
                  if n.startswith(PREFIX + ".") and n.endswith(suffix))


def reclaim(node: str, dry_run: bool = False) -> list[str]:
    """Unlink every object of `node` if its owner is dead; raise NodeLive if it is alive.

    Returns the names removed (or, with dry_run, that would be removed)."""
    name = object_name(node, "registry")
    if not segment_exists(name):
        return []
    try:
        reg = Registry.attach(node)
    except IpcError:
        # Header not written yet: a launcher starting right now, or one that died doing so.
        if time.time() - os.path.getmtime(os.path.join(SHM_DIR, name)) < 5.0:
            raise NodeLive(f"node {node} is starting (registry not initialised yet)") from None
        if dry_run:
            return [name]
        return [name] if unlink_segment(name) else []
    try:
        if reg.owner_alive():
            raise NodeLive(f"node {node} is live (launcher pid {reg.owner_pid}); refusing to touch it")
        entries = reg.entries()
    finally:
        reg.close()
    if dry_run:
        return [e.name for e in entries] + [name]
    removed = _unlink_entries(entries)
    if unlink_segment(name):
        removed.append(name)
    return removed
