"""Decode steps replayed as CUDA graphs: batch-size buckets, static input buffers, capture at
start-up, replay per step.

Why: a decode step of a small model is a few hundred kernel launches whose own work is a
fraction of a millisecond; launched from Python each costs tens of microseconds. A CUDA graph
records the launches once and replays them with one call, so a step costs its kernels' time.
A graph replays exactly what it recorded: the same kernels, the same buffers, the same grid.
So each bucket (1, 2, 4, 8, ... sequences) is captured once over fixed input buffers, a batch
runs in the smallest bucket that holds it (the rest padding rows: token 0, position 0, slot -1
so nothing is written, context 0 so nothing is attended), and before each replay the step's
inputs are copied into those buffers: one host-to-device copy of the tokens, positions, slots
and context lengths packed together with the block tables, then the tables into their rows.

Prefill and mixed steps stay eager (their shapes vary too much to capture), and so does every
step of a node with --tp > 1: its all-reduce waits on counters in host shared memory, which a
graph cannot replay.

Capture is bounded in time (`DecodeGraphs.capture`): buckets are captured smallest first until
the budget is spent, and a batch larger than every captured bucket runs eager; the worker's
warm-up gives the budget out of the node's --ready-timeout and logs what it captured and how
long it took.

`GraphMaker` is the one place that touches torch.cuda.CUDAGraph; the tests put a recording
stand-in in its place to check the bucketing, padding and replay bookkeeping on a CPU.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

log = logging.getLogger("kvrt.workers.model.graphs")

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512)
FIELDS = 4  # token, position, slot, context length: the packed rows' fields


def buckets_up_to(max_batch: int) -> list[int]:
    """The batch sizes captured for decode batches of up to `max_batch` sequences: every
    bucket below it and `max_batch` itself."""
    out = [b for b in BUCKETS if b < max_batch]
    return out + [max_batch] if max_batch > 0 else []


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `batch` rows (None: none does)."""
    return next((b for b in sorted(buckets) if b >= batch), None)


class Replayable(Protocol):
    output: Any

    def replay(self) -> None: ...


class GraphMaker(Protocol):
    def capture(self, body: Callable[[], Any]) -> Replayable:
        """Record `body` (which reads only static buffers) once; its result tensor is where
        every replay leaves its output."""


class CudaGraphMaker:
    """torch.cuda.CUDAGraph: every graph in one memory pool (a smaller bucket's buffers come
    out of what a larger one freed), each captured after two runs on a side stream that
    compile the Triton kernels and let cuBLAS set up its workspaces outside the capture."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.pool: Any = None
        self.stream = torch.cuda.Stream()

    def capture(self, body: Callable[[], Any]) -> Replayable:
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            body()
            body()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body()
        if self.pool is None:
            self.pool = graph.pool()
        return _Captured(graph, out)


@dataclass
class _Captured:
    graph: Any
    output: Any

    def replay(self) -> None:
        self.graph.replay()


class StaticInputs:
    """The buffers every decode graph reads: a packed int32 area (each bucket's fields as
    [FIELDS, bucket], then the step's block tables [batch, width]) and the tables' own
    [max_batch, max_width] array, which the graphs index through."""

    def __init__(self, torch: Any, device: str, max_batch: int, max_width: int) -> None:
        self.torch, self.max_batch, self.max_width = torch, max_batch, max_width
        n = FIELDS * max_batch + max_batch * max_width
        self.packed = torch.zeros(n, dtype=torch.int32, device=device)
        self.tables = torch.zeros((max_batch, max_width), dtype=torch.int32, device=device)
        self.host = torch.zeros(n, dtype=torch.int32, pin_memory=device.startswith("cuda"))
        self.host_np = self.host.numpy()
        self._copied: Any = None  # the event after the last host-to-device copy (a GPU's)

    def clear(self, bucket: int) -> None:
        """Every row of `bucket`'s layout a padding row: no slot written, no context read (what
        its capture runs over)."""
        self.packed.zero_()
        self.packed[2 * bucket:3 * bucket] = -1

    def fields(self, bucket: int) -> tuple[Any, Any, Any, Any]:
        """Views of a bucket's tokens, positions, slots and context lengths."""
        p = self.packed
        return tuple(p[i * bucket:(i + 1) * bucket] for i in range(FIELDS))

    def load(self, bucket: int, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
             context: np.ndarray, tables: np.ndarray) -> None:
        """The step's rows into the bucket's fields (padding rows after them) and their block
        tables [batch, width] into the tables' first rows."""
        batch, width = tables.shape
        if self._copied is not None:
            self._copied.synchronize()  # the pinned area is the previous copy's source until it landed
        h = self.host_np
        for i, (vals, pad) in enumerate(((tokens, 0), (positions, 0), (slots, -1), (context, 0))):
            h[i * bucket:i * bucket + batch] = vals
            h[i * bucket + batch:(i + 1) * bucket] = pad
        head = FIELDS * bucket
        h[head:head + batch * width] = tables.reshape(-1)
        n = head + batch * width
        self.packed[:n].copy_(self.host[:n], non_blocking=True)
        self.tables[:batch, :width].copy_(self.packed[head:n].view(batch, width))
        if self.host.is_pinned():
            self._copied = self.torch.cuda.Event()
            self._copied.record()


@dataclass
class CaptureReport:
    """What a capture did: the buckets captured, those left to run eager, and the seconds."""

    captured: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    seconds: float = 0.0


class DecodeGraphs:
    """One graph per bucket over one pool, each made by `body_for(bucket)` (a function that runs
    the decode step over the static inputs' first `bucket` rows and returns its logits)."""

    def __init__(self, maker: GraphMaker, static: StaticInputs, body_for: Callable[[int], Callable[[], Any]],
                 pool_key: Any) -> None:
        self.maker, self.static, self.body_for, self.pool_key = maker, static, body_for, pool_key
        self.graphs: dict[int, Replayable] = {}
        self.replays = 0

    def capture(self, buckets: list[int], budget_s: float, beat: Callable[[], None] | None = None) -> CaptureReport:
        """Capture each bucket, smallest first, until `budget_s` seconds have gone (the one in
        progress then finishes); the rest stay uncaptured (their batches run eager)."""
        report = CaptureReport()
        t0 = time.monotonic()
        for b in sorted(buckets):
            if b > self.static.max_batch:
                raise ValueError(f"bucket {b} exceeds the static inputs' {self.static.max_batch} rows")
            if time.monotonic() - t0 > budget_s:
                report.skipped.append(b)
                continue
            self.static.clear(b)
            self.graphs[b] = self.maker.capture(self.body_for(b))
            report.captured.append(b)
            if beat is not None:
                beat()
        report.seconds = time.monotonic() - t0
        return report

    def covers(self, pool_key: Any, batch: int, width: int) -> bool:
        """Whether a decode batch of `batch` rows whose tables are `width` blocks wide over the
        pool `pool_key` can replay a graph."""
        return (pool_key == self.pool_key and width <= self.static.max_width
                and bucket_for(batch, list(self.graphs)) is not None)

    def run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, context: np.ndarray,
            tables: np.ndarray) -> Any:
        """Replay the bucket's graph over this batch (one row each, tables [batch, width]);
        returns the logits of its rows (a view of the graph's output, valid until the next
        replay)."""
        batch = len(tokens)
        bucket = bucket_for(batch, list(self.graphs))
        if bucket is None:
            raise ValueError(f"no captured bucket holds {batch} rows")
        self.static.load(bucket, tokens, positions, slots, context, tables)
        graph = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return graph.output[:batch]
