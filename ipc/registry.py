"""The per-node registry: the one place that lists every shared object of a node.

Why it exists: status readers and cleaners must never guess names, and a crashed node must
be reclaimable by someone else. So the owner (the launcher) *registers an object before it
creates it* and unlinks the registry *last*; the registry is therefore always a superset of
what exists in /dev/shm, and reclaiming a dead node is "unlink everything listed".

Layout of `kvrt.<node>.registry`: a 4 KiB header (magic, owner pid and start time, entry
count published with store-release), then fixed 512-byte slots, each a length-prefixed
msgpack map. Only the owner writes; readers load the count with acquire and read slots.

Damage: the segment is writable by any process of the node's user, so readers trust none of
it. A slot that does not decode to a well-formed entry of this node is skipped and listed in
`damaged`; reclaiming also sweeps every `kvrt.<node>.*` name in /dev/shm (node names have no
dots, so that prefix is this node's alone), so a damaged slot never leaks its object. Whether
the owner lives is decided first by an exclusive flock the owner holds on the registry file
for its whole life: the kernel drops it when the owner dies, and no write into the mapping can
forge or erase it. The pid in the header is only a second opinion, and any doubt refuses.
"""
from __future__ import annotations

import fcntl
import os
import re
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import psutil

from kvrt.ipc._atomic import Region
from kvrt.ipc.doorbell import Doorbell, unlink_doorbell
from kvrt.ipc.errors import IpcError, NodeLive
from kvrt.ipc.shm import (PREFIX, SHM_DIR, Segment, object_name, segment_exists, unlink_segment,
                  validate_node_name)
from kvrt.ipc.sockets import remove_socket_dir, socket_dir

MAGIC = int.from_bytes(b"KVRTREG1", "little")
VERSION = 1
HEADER = 4096
SLOT = 512
MAX_ENTRIES = 1024
_OFF_MAGIC, _OFF_VERSION, _OFF_PID, _OFF_START, _OFF_COUNT, _OFF_CREATED = 0, 8, 16, 24, 32, 40
_LEN = struct.Struct("<I")
KINDS = ("segment", "signal", "ring", "pool", "doorbell")
STARTING_GRACE_S = 5.0  # an uninitialised, unlocked registry younger than this may be a launcher starting


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

    def __init__(self, node: str, seg: Segment, lock_fd: int = -1):
        self.node = node
        self._seg = seg
        self._region = Region(seg.mm)
        self.owner = seg.owner
        self._lock_fd = lock_fd
        self.damaged: list[int] = []  # slots the last entries() call could not read

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
        try:
            lock_fd = _lock(name, wait_s=1.0)  # a cleaner may be looking at our fresh file
        except BaseException:
            seg.unlink()
            seg.close()
            raise
        if lock_fd < 0:  # we created the file, yet someone held its lock for a whole second
            seg.unlink()
            seg.close()
            raise IpcError(f"node {node}: could not lock the registry {name} (another process holds it)")
        reg = cls(node, seg, lock_fd)
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
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def unlink_all(self) -> list[str]:
        """Owner only: unlink every registered object and every other `kvrt.<node>.*` name
        (a damaged slot must not leak its object) and the node's private socket directory
        (ipc/sockets.py), then the registry itself (last)."""
        removed = _unlink_names(self.node, self.entries())
        removed += [socket_dir(self.node)] if remove_socket_dir(self.node) else []
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

    def owner_alive(self) -> bool:
        """True if the owner holds the registry lock or its pid (from the header) runs."""
        return lock_held(self._seg.name) or pid_alive(self.owner_pid, self._region.load64(_OFF_START))

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
        """Every readable entry; slots that are not a well-formed entry of this node are
        skipped and their indices left in `damaged`."""
        n = self._region.load64(_OFF_COUNT)
        out, self.damaged = [], []
        for i in range(min(n, MAX_ENTRIES)):
            info = self._slot(i)
            if info is None:
                self.damaged.append(i)
            else:
                out.append(info)
        return out

    def _slot(self, i: int) -> ObjectInfo | None:
        mm = self._seg.mm
        off = HEADER + i * SLOT
        (ln,) = _LEN.unpack_from(mm, off)
        if ln > SLOT - _LEN.size:
            return None
        try:
            d = msgpack.unpackb(bytes(mm[off + _LEN.size: off + _LEN.size + ln]))
            info = ObjectInfo(**d)
            info.shape = tuple(int(x) for x in info.shape)
        except (msgpack.UnpackException, ValueError, TypeError, KeyError):
            return None
        prefix = f"{PREFIX}.{self.node}."
        ok = (isinstance(info.name, str) and info.name.startswith(prefix) and _OBJ_RE.match(info.name)
              and info.kind in KINDS and isinstance(info.dtype, str) and isinstance(info.meta, dict)
              and isinstance(info.creator_pid, int) and isinstance(info.created, (int, float)))
        return info if ok else None

    def find(self, obj: str) -> ObjectInfo:
        """The entry of object `obj` (short name, without `kvrt.<node>.`)."""
        full = self.name_of(obj)
        for e in self.entries():
            if e.name == full:
                return e
        raise IpcError(f"node {self.node}: no object {obj!r} in the registry")

    # ---- creating registered objects ----------------------------------------------
    def create_segment(self, obj: str, size: int, kind: str = "segment", dtype: str = "",
                       shape: tuple = (), meta: dict | None = None, prefault: bool = True) -> Segment:
        name = self.name_of(obj)
        self.add(ObjectInfo(name, kind, dtype, tuple(shape), os.getpid(), time.time(), meta or {}))
        return Segment.create(name, size, prefault=prefault)

    def create_doorbell(self, obj: str) -> Doorbell:
        name = self.name_of(obj)
        self.add(ObjectInfo(name, "doorbell", creator_pid=os.getpid(), created=time.time()))
        return Doorbell.create(name)


_OBJ_RE = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


def _lock(name: str, wait_s: float = 0.0) -> int:
    """Open the segment file `name` and take its exclusive flock, trying for up to `wait_s`:
    the fd (closed on exec, so children never hold it), or -1 if another process holds it."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return -1
                os.sched_yield()  # a cleaner or status reader holds it for microseconds
    except BaseException:
        os.close(fd)
        raise


def lock_held(name: str) -> bool:
    """True if a process (a live owner) holds the flock of segment `name`."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops our shared lock, if we took it


def node_names(node: str) -> list[tuple[str, str]]:
    """(name, kind) of every object in /dev/shm named after `node`, registry excluded."""
    registry = object_name(node, "registry")
    seg_prefix, sem_prefix = f"{PREFIX}.{node}.", f"sem.{PREFIX}.{node}."
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for n in sorted(names):
        if n.startswith(sem_prefix):
            out.append((n[len("sem."):], "doorbell"))
        elif n.startswith(seg_prefix) and n != registry:
            out.append((n, "segment"))
    return out


def _unlink_names(node: str, entries: list[ObjectInfo]) -> list[str]:
    """Unlink the registered objects (newest first), then whatever else carries the node's
    prefix; the registry itself is left to the caller (it goes last)."""
    removed = []
    for name, kind in [(e.name, e.kind) for e in reversed(entries)] + node_names(node):
        gone = unlink_doorbell(name) if kind == "doorbell" else unlink_segment(name)
        if gone:
            removed.append(name)
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
    """Unlink every object of `node` if its owner is dead; raise NodeLive if it is alive or
    might be (the registry lock is held, the header's owner pid runs, or an uninitialised
    registry is young enough to be a launcher starting).

    Returns the names removed (or, with dry_run, that would be removed)."""
    validate_node_name(node)
    name = object_name(node, "registry")
    if not segment_exists(name):
        return []
    try:
        fd = _lock(name)
    except FileNotFoundError:
        return []  # its owner unlinked it just now
    if fd < 0:
        raise NodeLive(f"node {node} is live (its launcher holds the registry lock); refusing to touch it")
    try:
        try:
            reg = Registry.attach(node)
        except IpcError:
            # Header not written: a launcher starting right now (before it takes the lock), or
            # one that died doing so, or a damaged header.
            if time.time() - os.path.getmtime(os.path.join(SHM_DIR, name)) < STARTING_GRACE_S:
                raise NodeLive(f"node {node} is starting (registry not initialised yet)") from None
            entries = []
        else:
            try:
                if pid_alive(reg.owner_pid, reg.owner_start_ms):
                    raise NodeLive(f"node {node} is live (launcher pid {reg.owner_pid}); refusing to touch it")
                entries = reg.entries()
            finally:
                reg.close()
        sockets = [socket_dir(node)] if os.path.isdir(socket_dir(node)) else []
        if dry_run:
            names = [e.name for e in entries]
            return names + [n for n, _ in node_names(node) if n not in names] + sockets + [name]
        removed = _unlink_names(node, entries)
        removed += [socket_dir(node)] if remove_socket_dir(node) else []
        if unlink_segment(name):
            removed.append(name)
        return removed
    finally:
        os.close(fd)
