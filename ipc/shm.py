"""Named POSIX shared-memory segments: created 0600 by one owner, attached by others.

Why not `multiprocessing.shared_memory`: on Python < 3.13 it registers even *attached*
segments with the resource tracker, which unlinks them when the attaching process exits,
pulling the floor from under the rest of the node. posix_ipc + mmap has no tracker.
"""
from __future__ import annotations

import mmap
import os
import re

import posix_ipc

from kvrt.ipc.errors import IpcError

PREFIX = "kvrt"
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


def object_name(node: str, obj: str) -> str:
    """The one naming rule of the project: `kvrt.<node>.<object>`."""
    name = f"{PREFIX}.{node}.{obj}"
    if not _NAME_RE.match(name) or len(name) > 200:
        raise ValueError(f"invalid shared-memory object name {name!r}: use letters, digits, '_', '-', '.'")
    return name


def validate_node_name(node: str) -> str:
    if not node or not re.match(r"^[A-Za-z0-9_\-]+$", node) or len(node) > 64:
        raise ValueError(f"invalid node name {node!r}: 1-64 letters, digits, '_' or '-' (no dots)")
    return node


class Segment:
    """A mapped segment. The creator owns it (and unlinks it); attachers only map it."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.mm = mm
        self.size = len(mm)
        self.owner = owner

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = True) -> "Segment":
        """Create `name` (0600) and map it. With `prefault` (the default) every page is
        allocated now (posix_fallocate: a full /dev/shm is an error here, naming the sizes,
        not a SIGBUS at the first write into a hole later) and mapped (MAP_POPULATE)."""
        if size <= 0:
            raise ValueError(f"segment {name}: size must be positive, got {size}")
        try:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError:
            raise IpcError(f"shared-memory segment {name} already exists") from None
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
        try:
            if prefault:
                _allocate(shm.fd, name, size)
            mm = mmap.mmap(shm.fd, size, flags=flags)
        except BaseException:
            unlink_segment(name)
            raise
        finally:
            shm.close_fd()
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        try:
            shm = posix_ipc.SharedMemory("/" + name)
        except posix_ipc.ExistentialError:
            raise IpcError(f"shared-memory segment {name} does not exist (is the node running?)") from None
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        return cls(name, mm, owner=False)

    def close(self) -> None:
        """Unmap; views still exported (numpy arrays) keep the mapping alive until they die."""
        try:
            self.mm.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        unlink_segment(self.name)


def unlink_segment(name: str) -> bool:
    """Remove a segment's name; True if it existed. Mappings stay valid until unmapped."""
    try:
        posix_ipc.unlink_shared_memory("/" + name)
        return True
    except posix_ipc.ExistentialError:
        return False


def segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _allocate(fd: int, name: str, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        free = shm_free_bytes()
        raise IpcError(f"no room in {SHM_DIR} for {name}: it needs {size / 2**20:.1f} MiB, "
                       f"{free / 2**20:.1f} MiB are free ({e.strerror})") from None


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize
