"""The KV pools of a node and the block copies between them.

Per rank there is a device pool and, when a CPU tier is configured, a host pool, both
block-major `[num_blocks, layers, 2, block_size, kv_heads_per_rank, head_dim]`: one block is
one contiguous byte range, so a run of consecutive blocks is one memcpy. The launcher creates
every pool up front (`PoolMaker`: `bytes_needed` for its /dev/shm check, then `create`),
pre-faulted so the first swap
does not pay for page faults; each child of a rank opens its pair with `attach_pools`.

Every pool's shape comes from the node's KV layout (`NodeConfig.kv_layout`, ipc/layout.py), the
same spec the model, the transports and the launcher's sizing use.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvrt.ipc import protocol
from kvrt.ipc.config import NodeConfig
from kvrt.ipc.layout import KVLayout
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import spin_for

from kvrt.workers.backend import ArrayBackend, DeviceMemoryError, Pool, Run, create_shm_pool, get_backend

BEAT_BYTES = 256 << 20  # copy this much between liveness callbacks (~15 ms on a CPU)


class PoolError(ValueError):
    """A copy order is invalid: block ids out of range, unpaired, or pools that do not match."""


@dataclass(frozen=True)
class PoolSpec:
    """One pool of the node: whose, which tier, its registry name, shape and size."""

    rank: int
    tier: str  # "device" or "host"
    obj: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    in_shm: bool  # lives in /dev/shm (host pools, and device pools on CPU machines)


def pool_specs(cfg: NodeConfig) -> list[PoolSpec]:
    """Every pool the node's configuration asks for, rank by rank."""
    layout = cfg.kv_layout
    specs = []
    for r in range(cfg.tp):
        n = cfg.num_gpu_blocks
        specs.append(PoolSpec(r, "device", protocol.device_pool(r), layout.pool_shape(n), layout.storage_dtype.name,
                              layout.pool_bytes(n), cfg.device == "cpu"))
        if cfg.num_cpu_blocks > 0:
            n = cfg.num_cpu_blocks
            specs.append(PoolSpec(r, "host", protocol.host_pool(r), layout.pool_shape(n), layout.storage_dtype.name,
                                  layout.pool_bytes(n), True))
    return specs


def shm_bytes_needed(cfg: NodeConfig) -> int:
    """Bytes of /dev/shm the pools will take (rings and signals are small on top of that)."""
    return sum(s.nbytes for s in pool_specs(cfg) if s.in_shm)


def fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


# ---- device pool size on a GPU ---------------------------------------------------------------

def ranks_per_device(tp: int, num_devices: int) -> list[int]:
    """How many ranks' device pools each GPU holds (rank r lives on GPU r % num_devices)."""
    if num_devices <= 0:
        raise ValueError(f"no GPU to place {tp} rank(s) on")
    return [len(range(d, tp, num_devices)) for d in range(num_devices)]


def plan_gpu_blocks(requested: int | None, utilization: float, block_bytes: int, tp: int,
                    free_per_device: Sequence[int]) -> int:
    """Device blocks per rank on a GPU machine, decided before anything is allocated.

    `requested` (--num-gpu-blocks) is checked against the free memory of every GPU its ranks
    share, so asking for more than a GPU holds is refused with what is free and what was asked
    (not a raw allocation error half-way through start-up). Without it the count is the largest
    that takes at most `utilization` of the free memory on the GPU with the least of it per rank,
    so every rank gets the same count; the rest is left to the model and other processes.
    Raises DeviceMemoryError when not even the asked (or one) block fits."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    share = ranks_per_device(tp, len(free_per_device))
    used = [(d, free, n) for d, (free, n) in enumerate(zip(free_per_device, share)) if n]
    if requested is None:
        blocks = min(int(free * utilization) // (block_bytes * n) for _, free, n in used)
        if blocks < 1:
            d, free, n = min(used, key=lambda u: u[1] // u[2])
            raise DeviceMemoryError(
                f"GPU {d} has {fmt_bytes(free)} free; {utilization:g} of it (--gpu-memory-utilization) "
                f"does not hold one {fmt_bytes(block_bytes)} block for each of its {n} rank(s)")
        return blocks
    for d, free, n in used:
        need = requested * block_bytes * n
        if need > free:
            raise DeviceMemoryError(
                f"--num-gpu-blocks {requested} needs {fmt_bytes(need)} on GPU {d} ({n} rank(s) x {requested} "
                f"blocks x {fmt_bytes(block_bytes)}) but it has {fmt_bytes(free)} free; ask for at most "
                f"{free // (block_bytes * n)} blocks, or leave --num-gpu-blocks out to take "
                f"--gpu-memory-utilization of the free memory")
    return requested


def cuda_free_bytes() -> list[int]:
    """Free bytes of every GPU CuPy sees (CuPy imported only here, on a GPU launch)."""
    from kvrt.workers.backend import CupyBackend

    rt = CupyBackend().rt
    free = []
    for d in range(rt.getDeviceCount()):
        rt.setDevice(d)
        free.append(int(rt.memGetInfo()[0]))
    return free


@dataclass
class CreatedPools:
    """What the creator of the pools keeps until the node stops: CUDA allocations exported by
    IPC handle live only as long as the process that made them. Shared-memory pools need
    nothing here; the registry owner unlinks them."""

    keep: list[Any] = field(default_factory=list)

    def close(self) -> None:
        self.keep.clear()


def create_pools(reg: Registry, cfg: NodeConfig, progress: Callable[[str], None]) -> CreatedPools:
    """Create, register and pre-fault every rank's pools; one progress line per pool."""
    backend = get_backend(cfg.device)
    created = CreatedPools()
    for s in pool_specs(cfg):
        t0 = time.perf_counter()
        if s.tier == "device":
            kept = backend.create_device_pool(reg, s.obj, s.shape, s.dtype, s.rank)
            if kept is not None:
                created.keep.append(kept)
        else:
            create_shm_pool(reg, s.obj, s.shape, s.dtype, {"backend": "numpy", "tier": "host", "rank": s.rank})
        where = "/dev/shm, pre-faulted" if s.in_shm else f"{backend.name} device memory"
        progress(f"{s.obj}: {s.shape[0]} blocks x {fmt_bytes(s.nbytes // s.shape[0])} = "
                 f"{fmt_bytes(s.nbytes)} ({where}) in {time.perf_counter() - t0:.2f}s")
    return created


class PoolMaker:
    """The launcher's handle on the pools (runtime.node.supervisor.PoolMaker): their /dev/shm size for the
    room check before anything is created, and their creation. It keeps what must outlive
    creation (CUDA allocations) for as long as the launcher holds it."""

    def __init__(self) -> None:
        self.created = CreatedPools()

    def bytes_needed(self, cfg: NodeConfig) -> int:
        return shm_bytes_needed(cfg)

    def create(self, reg: Registry, cfg: NodeConfig, progress: Callable[[str], None]) -> None:
        self.created = create_pools(reg, cfg, progress)


def attach_pools(reg: Registry, rank: int, cfg: NodeConfig) -> tuple[Pool, Pool | None]:
    """Open rank `rank`'s device pool and its host pool (None without a CPU tier), refusing a
    pool whose blocks are not the node's KV layout."""
    backend = get_backend(cfg.device)
    device = backend.open_device_pool(reg, protocol.device_pool(rank))
    host = backend.open_host_pool(reg, protocol.host_pool(rank)) if cfg.num_cpu_blocks > 0 else None
    for pool in (device, host):
        if pool is not None:
            check_layout(pool, cfg.kv_layout)
    return device, host


def check_layout(pool: Pool, layout: KVLayout) -> None:
    """PoolError naming what differs unless `pool` holds blocks of `layout`."""
    try:
        theirs = KVLayout.of_pool_shape(pool.array.shape, pool.array.dtype)
    except ValueError as e:
        raise PoolError(f"{pool.name}: {e}") from None
    if diff := layout.differences(theirs):
        raise PoolError(f"{pool.name} holds blocks of {theirs}, the node's layout is {layout} ("
                        + ", ".join(f"{what} {got} instead of {want}" for what, want, got in diff) + ")")


# ---- block copies ---------------------------------------------------------------------------

def check_blocks(ids: np.ndarray, num_blocks: int, what: str) -> np.ndarray:
    """`ids` as int64, or PoolError naming the first id outside [0, num_blocks)."""
    ids = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))
    if bad.size:
        raise PoolError(f"{what} block id {int(ids[bad[0]])} out of range 0..{num_blocks - 1} "
                        f"({bad.size} of {ids.size} ids bad)")
    return ids


def block_list(ids: Sequence[int] | np.ndarray, num_blocks: int, what: str) -> list[int]:
    """`ids` as a list of ints, or PoolError as `check_blocks` raises it.

    The task path's check: a task's ids arrive as an int32 array, and min/max over a list
    cost ~0.5 us for one block where the vectorised check costs ~5 us (a tenth of a
    one-block swap's overhead); the list is also what coalescing walks."""
    arr = np.asarray(ids).reshape(-1)
    if arr.dtype.kind not in "iu":
        arr = check_blocks(arr, num_blocks, what)
    out = arr.tolist()
    if out and (min(out) < 0 or max(out) >= num_blocks):
        check_blocks(arr, num_blocks, what)  # raises, naming the first bad id
    return out


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Pair src[i] with dst[i] and merge stretches where both advance by one into runs.

    A plain loop: faster than the vectorised form up to a few hundred blocks (measured 1 us
    vs 17 us for one block, 37 us vs 41 us for 256), and dwarfed by the copies beyond."""
    return _coalesce(np.asarray(src).tolist(), np.asarray(dst).tolist())


def _coalesce(src: list[int], dst: list[int]) -> list[Run]:
    if len(src) != len(dst):
        raise PoolError(f"copy order pairs {len(src)} source blocks with {len(dst)} destination blocks")
    runs: list[Run] = []
    s0 = d0 = n = 0
    for s, d in zip(src, dst):
        if n and s == s0 + n and d == d0 + n:
            n += 1
            continue
        if n:
            runs.append((s0, d0, n))
        s0, d0, n = s, d, 1
    if n:
        runs.append((s0, d0, n))
    return runs


@dataclass
class CopyJob:
    """A copy order handed to the backend. On a CPU its bytes have landed when `start_copy`
    returns; on a GPU they land later, in issue order, and `wait` is where the caller learns
    it (one event per BEAT_BYTES of the order, not one synchronisation per block)."""

    backend: ArrayBackend
    marks: list[Any]
    blocks: int
    nbytes: int

    def done(self) -> bool:
        """Whether every byte has landed (never waits): the last mark covers all before it."""
        return not self.marks or self.backend.is_done(self.marks[-1])

    def wait(self, beat: Callable[[], None] | None = None, spin_s: float = 0.0) -> int:
        """Wait until every byte landed, running `beat` after each mark; returns the bytes. With
        `spin_s`, each mark is first polled (`is_done`) for up to that long: a short copy's end
        is then seen at once, where a blocking wait may sleep past it."""
        while self.marks:
            mark = self.marks.pop(0)
            if spin_s > 0:
                spin_for(lambda: self.backend.is_done(mark), spin_s)
            self.backend.wait(mark)
            if beat is not None:
                beat()
        return self.nbytes


def start_copy(dst: Pool, src: Pool, dst_ids: Sequence[int] | np.ndarray, src_ids: Sequence[int] | np.ndarray,
               beat: Callable[[], None] | None = None) -> CopyJob:
    """Check a copy order (block src_ids[i] of `src` into block dst_ids[i] of `dst`) and issue
    it, one copy per run of consecutive pairs, in batches of BEAT_BYTES. A refused order
    (PoolError) copies nothing. A synchronous backend copies here and runs `beat` after each
    batch, so a huge order does not make the copying process look dead; a device's batches
    are waited for (and beaten between) in `CopyJob.wait`."""
    if dst.block_bytes != src.block_bytes:
        raise PoolError(f"block size mismatch: {src.name} {src.block_bytes} B, {dst.name} {dst.block_bytes} B")
    runs = _coalesce(block_list(src_ids, src.num_blocks, src.name), block_list(dst_ids, dst.num_blocks, dst.name))
    backend, bb = src.backend, src.block_bytes
    blocks = sum(r[2] for r in runs)
    marks: list[Any] = []
    i = 0
    while True:
        j, pending = i, 0
        while j < len(runs) and pending < BEAT_BYTES:
            pending += runs[j][2] * bb
            j += 1
        mark = backend.issue_runs(dst, src, runs[i:j])
        if mark is not None:
            marks.append(mark)
        elif beat is not None and pending >= BEAT_BYTES:
            beat()
        i = j
        if i >= len(runs):
            break
    return CopyJob(backend, marks, blocks, blocks * bb)


def copy_blocks(dst: Pool, src: Pool, dst_ids: Sequence[int] | np.ndarray, src_ids: Sequence[int] | np.ndarray,
                beat: Callable[[], None] | None = None) -> int:
    """Copy block src_ids[i] of `src` into block dst_ids[i] of `dst` and return the bytes
    copied once all landed (`start_copy` then `CopyJob.wait`)."""
    return start_copy(dst, src, dst_ids, src_ids, beat).wait(beat)
