"""Storage backends for KV blocks beyond the host tier, and the `file:DIR` one.

A storage object is one rank's slice of a block: the engine computes a key per block (16 bytes
from the prefix cache's key function) and every rank stores its own bytes under (key, rank).
Reads are best effort by design: a missing, truncated or corrupt object is a miss, never a
crash, because the engine treats storage as a cache and recomputes what it cannot read.

`file:DIR` layout: DIR/<first two hex digits>/<key hex>.r<rank>.kvb, written to a temporary
name and moved into place with os.replace, so a reader sees the old object or the new one,
never half of one. Every object carries an xxh3-64 of its key and payload in its header and
`get` verifies it (and the length) before it reports a hit, so a truncated, corrupted or
misplaced file is a miss and its block is recomputed. With a storage secret the header also
carries the object's MAC (workers/storage/mac.py: a checksum guards against damage, the MAC
against blocks planted by whoever else can write into the directory); a missing or wrong one
is a miss counted as forged, and the payload is read into a buffer of this backend and
checked before it is copied into the pool. There is no fsync: after a power loss a
torn file fails its checksum and is a miss, which is all a cache needs. Directories are
created 0700 and objects 0600 whatever the umask: KV blocks are the users' prompts in another
form, as private as the prompts. An existing directory of another user, or one that lets group
or others in, is refused (ipc/private.py).

`max_bytes` caps what a rank's objects take (each rank gets its share of the directory's cap):
a write that goes over it deletes the least recently used objects (by the time they were last
written or read, which reads refresh) down to 7/8 of the cap, so eviction runs once per many
writes rather than on every one. Other ranks' and nodes' files are never deleted.

A shared store (Mooncake, workers/storage/mooncake.py) implements the same interface; the
batch methods (`exists_many`, `get_many`, `put_many`) are what the cache-transfer process
calls, so a backend with batched I/O overrides them and the others inherit the loops below.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Iterator, Sequence

import numpy as np
import xxhash

from kvrt.ipc.private import check_private_dir

from kvrt.workers.storage.mac import MAC_BYTES, BlockMac

log = logging.getLogger(__name__)

MAGIC = b"KVRTBLK2"
DIR_MODE = 0o700
FILE_MODE = 0o600
_HEADER = struct.Struct(f"<8sQQ{MAC_BYTES}s")  # magic, payload length, xxh3-64 of key + payload, MAC (zeros: none)
_NO_MAC = bytes(MAC_BYTES)


class StorageError(RuntimeError):
    """A write failed (disk full, permissions): the task that asked fails, the process lives."""


class StoreHung(RuntimeError):
    """A store call did not return in time and may still write into blocks: the process exits."""


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

    errors = 0  # store failures (error returns, exceptions, damaged objects) answered as misses so far
    forged = 0  # objects without a valid MAC answered as misses so far (only with a MAC signer)
    mac: BlockMac | None = None  # signs what is written, checks what is read (None: no storage secret)
    where = ""  # the store, as its log lines name it
    beat: Callable[[], None] = staticmethod(lambda: None)  # the caller's heartbeat, while a batch runs

    def register(self, array: np.ndarray) -> None:
        """`array` (a host-memory pool) is where reads land and writes come from from now on;
        a backend that moves bytes without a copy registers it with its transport."""

    def get_many(self, keys: Sequence[bytes], outs: Sequence[np.ndarray], deadline: float = 0.0) -> int:
        """Fill outs[i] with keys[i]'s object while they hit; returns how many leading blocks
        were read (the first miss ends the prefix; later buffers may be half-written). Past
        `deadline` (time.monotonic(); 0: none) nothing more is written into `outs`: the task
        that asked has expired and its blocks may be someone else's."""
        for i, (key, out) in enumerate(zip(keys, outs)):
            if deadline and time.monotonic() >= deadline:
                return i
            if not self.get(key, out):
                return i
            self.beat()
        return len(keys)

    def put_many(self, keys: Sequence[bytes], datas: Sequence[np.ndarray]) -> int:
        """Store every block whose key has no object yet; returns the bytes written."""
        written = 0
        for key, data in zip(keys, datas):
            if not self.contains(key):
                self.put(key, data)
                written += data.nbytes
            self.beat()
        return written

    def close(self) -> None:
        """Let go of connections and registrations (the objects stay)."""

    def _reject(self, name: str, why: str) -> None:
        """An object whose MAC is missing or wrong: counted and logged (the log filter of the
        process, ipc/log_limit.py, lets one such line out per interval), a miss."""
        self.forged += 1
        log.warning("storage %s: object %s %s: not served, a miss", self.where, name, why)


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

    def __init__(self, directory: str, rank: int, max_bytes: int = 0, mac: BlockMac | None = None):
        self.directory = os.path.abspath(directory)
        self.rank = rank
        self.max_bytes = max_bytes
        self.mac = mac
        self.where = self.directory
        self._tmp_seq = 0
        self._scratch = np.empty(0, np.uint8)  # where a signed object is checked before it reaches `out`
        try:
            _make_private_dirs(self.directory)
            check_private_dir(self.directory, "storage directory")
        except OSError as e:
            raise StorageError(f"storage directory {self.directory}: {e}") from None
        except ValueError as e:
            raise StorageError(str(e)) from None
        # key -> object bytes, least recently used first (only kept under a cap)
        self._used: OrderedDict[bytes, int] = OrderedDict()
        self._total = 0
        if max_bytes:
            self._scan()

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

    def _scan(self) -> None:
        """Learn this rank's objects, oldest use first, and trim them to the cap (it may have
        been lowered since they were written)."""
        found = []
        for key in self.keys():
            try:
                st = os.stat(self.path(key))
            except OSError:
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._used[key] = size
            self._total += size
        self._trim(self.max_bytes)

    def _trim(self, limit: int) -> None:
        """Delete least recently used objects until they take at most `limit` bytes."""
        dropped = 0
        while self._total > limit and self._used:
            key, size = self._used.popitem(last=False)
            self._total -= size
            try:
                os.unlink(self.path(key))
                dropped += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("storage eviction of %s failed: %s", self.path(key), e)
        if dropped:
            log.info("storage %s (rank %d): evicted %d objects to stay under %d bytes",
                     self.directory, self.rank, dropped, self.max_bytes)

    def _touch(self, key: bytes, path: str) -> None:
        """A read hit: the object is the most recently used (its mtime says so across restarts)."""
        if key in self._used:
            self._used.move_to_end(key)
            try:
                os.utime(path)
            except OSError:
                pass

    def _name(self, key: bytes) -> bytes:
        """What the MAC binds an object to: its key and rank."""
        return f"{key.hex()}.r{self.rank}".encode()

    def get(self, key: bytes, out: np.ndarray) -> bool:
        path = self.path(key)
        dest = _bytes_of(out)
        buf = dest
        if self.mac is not None:  # checked before a byte of it reaches the pool
            if self._scratch.nbytes < len(dest):
                self._scratch = np.empty(len(dest), np.uint8)
            buf = memoryview(self._scratch[:len(dest)])
        try:
            with open(path, "rb") as f:  # buffered: readinto fills the block or hits EOF
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return self._corrupt(path, "truncated header")
                magic, length, digest, mac = _HEADER.unpack(head)
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
            self.errors += 1
            return False
        if _digest(key, buf) != digest:
            return self._corrupt(path, "checksum mismatch")
        if self.mac is not None:
            if not self.mac.valid(self._name(key), buf, mac):
                self._reject(path, "has no MAC" if mac == _NO_MAC else "has a wrong MAC")
                _remove(path)  # (else `put_many` would never write the real block over it)
                return False
            dest[:] = buf
        self._touch(key, path)
        return True

    def _corrupt(self, path: str, why: str) -> bool:
        """A damaged object is a miss and is deleted: left in place it would make every later
        write of its block skip it (`put_many` writes only missing keys), so the prefix
        would end there for good."""
        log.warning("storage object %s is corrupt (%s): treated as a miss and removed", path, why)
        self.errors += 1
        _remove(path)
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
                mac = self.mac.of(self._name(key), buf) if self.mac is not None else _NO_MAC
                f.write(_HEADER.pack(MAGIC, len(buf), _digest(key, buf), mac))
                f.write(buf)
            os.replace(tmp, path)
            if self.max_bytes:
                size = _HEADER.size + len(buf)
                self._total += size - self._used.pop(key, 0)
                self._used[key] = size
                if self._total > self.max_bytes:
                    self._trim(self.max_bytes * 7 // 8)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StorageError(f"storage write {path} failed: {e}") from None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
