"""P->D block transport (P's cache-messager writes into D's pool): the interface (the factory:
`factory.py`).

A prefill node P hands a prompt's KV blocks to a decode node D by writing them straight into
D's device pool of the same rank, at block ids D chose. Both sides open a transport over their
own rank's device pool; the receiver only has to exist and publish `descriptor()` (a small
msgpack-able dict carried to P by the engines' handshake); the sender calls
`write_blocks(descriptor, src_ids, dst_ids)`.

Two kinds:
- "shm" (`shm.py`): P and D on one machine. The sender maps D's pool through D's
  registry and copies runs of blocks (numpy `copyto`, or CUDA IPC + cudaMemcpy on GPUs).
- "mooncake" (`mooncake.py`): any two machines, through the Mooncake Transfer Engine
  over TCP (default) or RDMA, P2P handshake mode (no metadata server).

Pools are block-major, so a run of consecutive source ids written to consecutive destination
ids is one contiguous byte range on both sides: one copy (`kv_pool.coalesce`).

Contract of `write_blocks`: it returns only once every byte has landed (or raises); it raises
TransferError, naming the peer and what failed, for every failure (bad ids, unreachable or dead
peer, layouts that do not match, a peer that does not answer) and never waits longer than the
transport's timeout. Bad ids are refused before anything is written. After any other failure
the destination blocks hold undefined bytes: D must treat them as garbage. The caller must own
(by the engine's order) the source blocks on its side and the destination blocks on D's side for
the whole call. A transport is used by one thread at a time and never closes the pool it was
opened over (the caller owns it).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from kvrt.workers.backend import Pool, Run
from kvrt.workers.kv_pool import PoolError, coalesce

TRANSPORTS = ("shm", "mooncake")


class TransferError(RuntimeError):
    """A P->D block write failed; the message names the peer and what failed."""


class TransportUnavailable(TransferError, ImportError):
    """The transport cannot run on this machine: a library or driver is missing (the message
    says what to install)."""


def machine_id() -> str:
    """An id of this boot of this machine: two descriptors with the same id can use "shm"."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def pool_layout(pool: Pool) -> dict[str, Any]:
    """The facts about a pool a peer needs to check that blocks fit: count, shape, dtype, size."""
    return array_layout(pool.array.shape, pool.array.dtype)


def array_layout(shape: Sequence[int], dtype: Any) -> dict[str, Any]:
    """`pool_layout` of a pool of `shape` ([blocks, *block_shape]) and `dtype`, also one not
    opened here (a peer's, from its registry entry)."""
    block_shape = [int(d) for d in shape[1:]]
    return {"num_blocks": int(shape[0]), "block_shape": block_shape, "dtype": np.dtype(dtype).str,
            "block_bytes": int(np.prod(block_shape)) * np.dtype(dtype).itemsize}


def describe_layout(layout: dict) -> str:
    shape = "x".join(str(d) for d in layout.get("block_shape", ()))
    return f"{layout.get('num_blocks', '?')} blocks of [{shape}] {np.dtype(layout.get('dtype', 'u1')).name}"


@dataclass(frozen=True)
class Endpoint:
    """This end of a transport: which node and rank it serves, the address peers reach it at
    (mooncake), the interface to bind ("" for `host`), and which run of the node it is
    ("" for none; shm block ids are only valid within one run)."""

    node: str
    rank: int = 0
    host: str = "127.0.0.1"
    bind: str = ""
    instance: str = ""


class Transport(ABC):
    """One rank's end of P->D block transfers, opened over that rank's device pool."""

    name = ""

    def __init__(self, pool: Pool, local: Endpoint):
        if pool.array is None:
            raise TransferError(f"{self.name} transport: pool {pool.name} is closed")
        self.pool = pool
        self.local = local
        self.closed = False

    @property
    def who(self) -> str:
        """This end, for messages: node and rank."""
        return f"node {self.local.node} rank {self.local.rank}"

    def layout(self) -> dict[str, Any]:
        return pool_layout(self.pool)

    @abstractmethod
    def descriptor(self) -> dict:
        """What the receiver publishes so a sender can reach its pool (msgpack-able)."""

    @abstractmethod
    def write_blocks(self, peer: dict, src_ids: np.ndarray, dst_ids: np.ndarray,
                     deadline: float | None = None) -> int:
        """Copy local block src_ids[i] into the peer's block dst_ids[i]; bytes written. Past
        `deadline` (time.monotonic()) no further byte is started: TransferError instead."""

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds (attachments, registrations); idempotent."""

    def _check_open(self) -> None:
        if self.closed:
            raise TransferError(f"{self.name} transport of {self.who} is closed")

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- helpers shared by the transports ------------------------------------------------------

def check_deadline(deadline: float | None, who: str) -> None:
    """TransferError once `deadline` passed: the peer may have reused the blocks by now."""
    if deadline is not None and time.monotonic() >= deadline:
        raise TransferError(f"write to {who}: the order expired {time.monotonic() - deadline:.3g}s ago "
                            f"(the peer may have reused its blocks); nothing more written")


def check_descriptor(peer: Any, kind: str, keys: Iterable[str]) -> dict:
    """`peer` as a dict of the right transport with every key in `keys`, else TransferError."""
    if not isinstance(peer, dict):
        raise TransferError(f"{kind} transport: peer descriptor must be a dict, got {type(peer).__name__}")
    if peer.get("transport") != kind:
        raise TransferError(f"{kind} transport: peer descriptor is for transport "
                            f"{peer.get('transport')!r} (node {peer.get('node', '?')}), not {kind!r}")
    missing = [k for k in keys if k not in peer]
    if missing:
        raise TransferError(f"{kind} transport: descriptor of node {peer.get('node', '?')} lacks "
                            f"{', '.join(missing)}")
    return peer


def check_same_layout(mine: dict, mine_name: str, theirs: dict, their_name: str) -> None:
    """TransferError naming both pools unless their blocks have the same shape and dtype."""
    same = (list(mine["block_shape"]) == list(theirs.get("block_shape", ()))
            and np.dtype(mine["dtype"]) == np.dtype(theirs.get("dtype", "V1"))
            and int(mine["block_bytes"]) == int(theirs.get("block_bytes", -1)))
    if not same:
        raise TransferError(f"block layouts differ: {mine_name} has {describe_layout(mine)}, "
                            f"{their_name} has {describe_layout(theirs)}")


def _as_ids(ids: Any, what: str, peer: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise TransferError(f"write to {peer}: {what} block ids must be a flat list, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TransferError(f"write to {peer}: {what} block ids must be integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def plan_runs(src_ids: Any, dst_ids: Any, src_blocks: int, dst_blocks: int, peer: str) -> tuple[list[Run], int]:
    """Check a write order and coalesce it: (runs, block count), or TransferError naming `peer`
    before anything is written (ids out of range, unpaired, or two writes to one block)."""
    src = _as_ids(src_ids, "source", peer)
    dst = _as_ids(dst_ids, "destination", peer)
    if src.size != dst.size:
        raise TransferError(f"write to {peer}: {src.size} source blocks paired with {dst.size} destination blocks")
    for ids, n, what in ((src, src_blocks, "source"), (dst, dst_blocks, "destination")):
        bad = np.flatnonzero((ids < 0) | (ids >= n))
        if bad.size:
            raise TransferError(f"write to {peer}: {what} block id {int(ids[bad[0]])} out of range "
                                f"0..{n - 1} ({bad.size} of {ids.size} ids bad)")
    if dst.size and np.unique(dst).size != dst.size:
        vals, counts = np.unique(dst, return_counts=True)
        raise TransferError(f"write to {peer}: destination block {int(vals[counts > 1][0])} is written "
                            f"more than once")
    try:
        return coalesce(src, dst), int(src.size)
    except PoolError as e:  # cannot happen after the checks above; kept so nothing else escapes
        raise TransferError(f"write to {peer}: {e}") from None
