"""Storage backends for KV blocks beyond the host tier, and the `file:DIR` one.

A storage object is one rank's slice of a block: the engine computes a key per block (16 bytes
from the prefix cache's key function) and every rank stores its own bytes under (key, rank).
Reads are best effort by design: a missing, truncated or corrupt object is a miss, never a
crash, because the engine treats storage as a cache and recomputes what it cannot read.

`file:DIR` layout: DIR/<first two hex digits>/<key hex>.r<rank>.kvb, written to a temporary
name and moved into place with os.replace, so a reader sees the old object or the new one,
never half of one. There is no fsync: after a power loss a torn file fails its checksum and
is a miss, which is all a cache needs. Directories are created 0700 and objects 0600 whatever
the umask: KV blocks are the users' prompts in another form, as private as the prompts.
"""
from __future__ import annotations

import logging
import os
import struct
from typing import Iterator
from abc import ABC, abstractmethod

import numpy as np
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"KVRTBLK1"
DIR_MODE = 0o700
FILE_MODE = 0o600
_HEADER = struct.Struct("<8sQQ")  # magic, payload length, xxh3-64 of key + payload


class StorageError(RuntimeError):
    """A write failed (disk full, permissions): the task that asked fails, the process lives."""


class Storage(ABC):
    """One rank's view of a block store, keyed by the engine's block keys."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """True if an object for `key` exists (it may still turn out corrupt on `get`)."""

    @abstractmethod
    def get(self, key: bytes, out: np.ndarray) -> bool:
        """Fill `out` (contiguous) with the object's bytes; False on a miss, without raising."""

    @abstractmethod
    def put(self, key: bytes, data: np.ndarray) -> None:
        """Store `data` (contiguous) under `key`; raises StorageError if it cannot."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every key with an object for this rank (the engine's storage index starts from it)."""


def _digest(key: bytes, payload: memoryview) -> int:
    h = xxhash.xxh3_64(key)
    h.update(payload)
    return h.intdigest()


def _bytes_of(a: np.ndarray) -> memoryview:
    if not a.flags.c_contiguous:
        raise ValueError("storage reads and writes need a contiguous buffer")
    return memoryview(a.reshape(-1).view(np.uint8))


class FileStorage(Storage):
    """One file per (key, rank) under a directory, with a checksummed header."""

    def __init__(self, directory: str, rank: int):
        self.directory = os.path.abspath(directory)
        self.rank = rank
        self._tmp_seq = 0
        try:
            _make_private_dirs(self.directory)
        except OSError as e:
            raise StorageError(f"storage directory {self.directory}: {e}") from None
        mode = os.stat(self.directory).st_mode & 0o777
        if mode & 0o077:
            log.warning("storage directory %s already existed with mode %o: other users may read "
                        "its KV blocks (chmod 700 it)", self.directory, mode)

    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.directory, h[:2], f"{h}.r{self.rank}.kvb")

    def contains(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    def keys(self) -> Iterator[bytes]:
        suffix = f".r{self.rank}.kvb"
        for sub in sorted(os.listdir(self.directory)):
            folder = os.path.join(self.directory, sub)
            if len(sub) != 2 or not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                if name.endswith(suffix):
                    try:
                        yield bytes.fromhex(name[:-len(suffix)])
                    except ValueError:
                        continue  # not one of ours

    def get(self, key: bytes, out: np.ndarray) -> bool:
        path = self.path(key)
        buf = _bytes_of(out)
        try:
            with open(path, "rb") as f:  # buffered: readinto fills the block or hits EOF
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return self._corrupt(path, "truncated header")
                magic, length, digest = _HEADER.unpack(head)
                if magic != MAGIC:
                    return self._corrupt(path, "bad magic")
                if length != len(buf):
                    return self._corrupt(path, f"holds {length} bytes, a block here is {len(buf)}")
                if f.readinto(buf) != length or f.read(1):
                    return self._corrupt(path, "length does not match the header")
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("storage read %s failed, treated as a miss: %s", path, e)
            return False
        if _digest(key, buf) != digest:
            return self._corrupt(path, "checksum mismatch")
        return True

    @staticmethod
    def _corrupt(path: str, why: str) -> bool:
        log.warning("storage object %s is corrupt (%s), treated as a miss", path, why)
        return False

    def put(self, key: bytes, data: np.ndarray) -> None:
        path = self.path(key)
        buf = _bytes_of(data)
        self._tmp_seq += 1
        tmp = os.path.join(os.path.dirname(path), f".tmp.{os.getpid()}.{self._tmp_seq}")
        try:
            _make_private_dirs(os.path.dirname(path))
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as f:
                os.fchmod(f.fileno(), FILE_MODE)  # the umask may have taken bits off
                # buffered: write writes everything or raises
                f.write(_HEADER.pack(MAGIC, len(buf), _digest(key, buf)))
                f.write(buf)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StorageError(f"storage write {path} failed: {e}") from None


def _make_private_dirs(path: str) -> None:
    """Create `path` and any missing parent 0700 (exactly, whatever the umask); directories
    that already exist are left as they are."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        _make_private_dirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return  # another rank made it meanwhile
    os.chmod(path, DIR_MODE)


def open_storage(uri: str, rank: int) -> Storage | None:
    """The storage backend a node's `storage` setting names, or None when it is empty.

    Supported: `file:DIR`."""
    if not uri:
        return None
    scheme, _, rest = uri.partition(":")
    if scheme == "file" and rest:
        return FileStorage(rest, rank)
    raise ValueError(f"unsupported storage {uri!r}: expected file:DIR")
