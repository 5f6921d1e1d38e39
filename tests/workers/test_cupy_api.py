"""The CuPy calls of the GPU paths, checked against the real CuPy module on any machine where it
imports (no GPU needed; skipped where CuPy is missing). The GPU code is written and unit-tested
on CPU machines through stand-ins, and runs only on a lent GPU: a misspelt runtime function, a
wrong argument count or a stand-in that drifted from CuPy would otherwise cost a GPU session.

- every `cupy.cuda.runtime` function the GPU code calls exists and takes that many positional
  arguments (CuPy's compiled functions state their signature in the docstring's first line);
- the CUDA constants workers/backend.py spells out equal CuPy's where CuPy exports them;
- the stand-in runtimes of the CPU tests take the same arguments as the real functions;
- a device pool opened by IPC handle and an all-reduce peer's slots are real `cupy.ndarray`s
  over the opened pointer (real CuPy classes, a stand-in runtime: none of this touches a GPU),
  and the swap's byte offsets on them are what the pool layout says.
"""
from __future__ import annotations

import ast
import contextlib
import re
from types import SimpleNamespace

import numpy as np
import pytest

from kvrt.ipc.registry import Registry
from tests.conftest import REPO

cupy = pytest.importorskip("cupy")
rt = cupy.cuda.runtime

GPU_SOURCES = ["workers/backend.py", "workers/cuda_allreduce.py", "workers/kv_pool.py", "bench/copy.py",
               "bench/model.py"]


def runtime_uses(path: str) -> list[tuple[str, int | None, int]]:
    """(name, positional argument count or None when only referenced, line) of every
    `<...>.rt.NAME` / `rt.NAME` / `cupy.cuda.runtime.NAME` in a source file, and of every call
    through a local name bound to one (`copy = self.rt.memcpyAsync`)."""
    tree = ast.parse(open(f"{REPO}/{path}").read(), path)

    def is_rt(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and (
            (isinstance(n.value, ast.Attribute) and n.value.attr in ("rt", "runtime"))
            or (isinstance(n.value, ast.Name) and n.value.id == "rt"))

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    counts = {id(c.func): len(c.args) for c in calls}
    aliases = {a.targets[0].id: a.value.attr for a in ast.walk(tree) if isinstance(a, ast.Assign)
               and len(a.targets) == 1 and isinstance(a.targets[0], ast.Name) and is_rt(a.value)}
    uses = [(n.attr, counts.get(id(n)), n.lineno) for n in ast.walk(tree) if is_rt(n)]
    uses += [(aliases[c.func.id], len(c.args), c.lineno) for c in calls
             if isinstance(c.func, ast.Name) and c.func.id in aliases]
    return uses


def cuda_uses(path: str) -> list[tuple[str, int]]:
    """(name, line) of every `cupy.cuda.NAME` (also through `cp`, `xp` or `self.cp`; not torch's)."""
    tree = ast.parse(open(f"{REPO}/{path}").read(), path)

    def is_cupy(node: ast.expr) -> bool:
        return ((isinstance(node, ast.Name) and node.id in ("cupy", "cp", "xp"))
                or (isinstance(node, ast.Attribute) and node.attr == "cp"))

    return [(n.attr, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "cuda"
            and is_cupy(n.value.value) and n.attr != "runtime"]


def arity(fn) -> tuple[int, int]:
    """(required, total) positional parameters of a CuPy runtime function, from the signature
    its docstring starts with (`memcpyAsync(intptr_t dst, ..., intptr_t stream)`)."""
    m = re.match(r"\w+\((.*?)\)", (fn.__doc__ or "").strip())
    assert m, f"{fn.__name__}: no signature in its docstring"
    params = [p.strip() for p in m.group(1).split(",") if p.strip()]
    return sum("=" not in p for p in params), len(params)


def test_every_runtime_function_the_gpu_code_calls_exists_with_that_many_arguments():
    seen = 0
    for path in GPU_SOURCES:
        for name, nargs, line in runtime_uses(path):
            where = f"{path}:{line}: cupy.cuda.runtime.{name}"
            assert hasattr(rt, name), f"{where} does not exist"
            fn = getattr(rt, name)
            if nargs is not None and callable(fn):
                lo, hi = arity(fn)
                assert lo <= nargs <= hi, f"{where} called with {nargs} arguments, takes {lo}..{hi}"
            seen += 1
    assert seen >= 15  # the scan found the backend's calls


def test_every_cupy_cuda_name_the_gpu_code_uses_exists():
    seen = 0
    for path in GPU_SOURCES + ["tests/workers/test_gpu.py", "tests/workers/model/test_gpu_model.py"]:
        for name, line in cuda_uses(path):
            assert hasattr(cupy.cuda, name), f"{path}:{line}: cupy.cuda.{name} does not exist"
            seen += 1
    assert seen >= 8  # the scan found the backend's classes
    assert hasattr(cupy.cuda.Stream, "null") and hasattr(cupy, "asnumpy") and hasattr(cupy, "copyto")


def test_the_backends_cuda_constants_are_cupys():
    from kvrt.workers import backend

    assert backend._MEMCPY_DEFAULT == rt.memcpyDefault
    assert backend._STREAM_NON_BLOCKING == rt.streamNonBlocking
    assert backend._EVENT_DISABLE_TIMING == rt.eventDisableTiming
    assert backend._HOST_REGISTER_PORTABLE == getattr(rt, "hostRegisterPortable", 1)  # cudaHostRegisterPortable
    # an opened handle maps with lazy peer access unless told otherwise (a peer on another GPU)
    assert "flags=cudaIpcMemLazyEnablePeerAccess" in rt.ipcOpenMemHandle.__doc__
    assert rt.cudaIpcMemLazyEnablePeerAccess == 1


@pytest.mark.parametrize("stand_in", ["tests.workers.test_swap_pipeline:FakeRuntime", "tests.workers.test_cuda_allreduce:_Runtime"])
def test_the_cpu_tests_stand_in_runtimes_take_cupys_arguments(stand_in):
    import importlib
    import inspect

    module, cls = stand_in.split(":")
    fake = getattr(importlib.import_module(module), cls)
    for name, method in inspect.getmembers(fake, inspect.isfunction):
        if name.startswith("_"):
            continue
        assert hasattr(rt, name), f"{stand_in}.{name} stands in for nothing in cupy.cuda.runtime"
        n = len(inspect.signature(method).parameters) - 1  # self
        lo, hi = arity(getattr(rt, name))
        assert lo <= n <= hi, f"{stand_in}.{name} takes {n} arguments, CuPy's {lo}..{hi}"


class OpenRuntime:
    """What opening a device pool asks of the CUDA runtime, without a GPU."""

    def __init__(self, ptr: int) -> None:
        self.ptr, self.device, self.copies = ptr, None, []

    def setDevice(self, device: int) -> None:  # noqa: N802 (CUDA's names)
        self.device = device

    def getDevice(self) -> int:  # noqa: N802
        return 0 if self.device is None else self.device

    def ipcOpenMemHandle(self, handle: bytes) -> int:  # noqa: N802
        assert len(handle) == 64  # cudaIpcMemHandle_t
        return self.ptr

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:  # noqa: N802
        self.copies.append((dst, src, nbytes))

    def streamCreateWithFlags(self, flags: int) -> int:  # noqa: N802
        return 7

    def eventCreateWithFlags(self, flags: int) -> int:  # noqa: N802
        return 9

    def eventRecord(self, event: int, stream: int) -> None:  # noqa: N802
        pass


def test_a_device_pool_opened_by_handle_is_a_cupy_array_over_the_mapping(node):
    from kvrt.workers.backend import CupyBackend, Pool

    shape, dtype = (6, 2, 2, 4, 2, 8), "float16"
    bb = int(np.prod(shape[1:])) * 2
    creator = CupyBackend.__new__(CupyBackend)
    creator.rt = SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=lambda: (1 << 30, 1 << 30),
                                 memset=lambda *a: None, deviceSynchronize=lambda: None,
                                 ipcGetMemHandle=lambda ptr: bytes(range(64)))
    creator.cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext(),
                                                      Memory=lambda n: SimpleNamespace(ptr=1 << 20, size=n)))
    opener = CupyBackend.__new__(CupyBackend)
    opener.cp, opener.rt, opener._stream, opener._events = cupy, OpenRuntime(1 << 32), 0, []
    with Registry.create(node) as reg:
        creator.create_device_pool(reg, "pool", shape, dtype, 0)
        pool = opener.open_device_pool(reg, "pool")
    assert opener.rt.device == 0, "the pool's device is made current before its handle is opened"
    assert isinstance(pool.array, cupy.ndarray) and pool.array.shape == shape and pool.array.dtype == np.float16
    assert pool.array.data.ptr == 1 << 32 and pool.on_device and pool.block_bytes == bb
    host = Pool("host", np.zeros(shape, np.float16), opener, False, lambda: None)
    opener.issue_runs(host, pool, [(4, 1, 2)])  # device blocks 4, 5 -> host blocks 1, 2
    assert opener.rt.copies == [(host.array.ctypes.data + bb, (1 << 32) + 4 * bb, 2 * bb)]


def test_an_allreduce_peers_slots_are_a_cupy_float32_array_over_the_mapping(monkeypatch):
    from kvrt.workers.cuda_allreduce import CudaPeerMemory

    mem = CudaPeerMemory()
    mem.rt = OpenRuntime(1 << 33)
    slots = mem.open(bytes(64), 2 * 100 * 4)
    assert isinstance(slots, cupy.ndarray) and slots.dtype == np.float32 and slots.shape == (200,)
    assert slots.data.ptr == 1 << 33 and slots.reshape(2, 100)[1].data.ptr == (1 << 33) + 400
    assert mem._opened == [1 << 33]


def test_a_staging_buffer_is_a_numpy_array_over_cupys_pinned_pointer(monkeypatch):
    """`host_buffer` reads CuPy's pinned allocation through the buffer protocol (CuPy's own
    idiom); the allocation is stood in for by host bytes, the pointer class is CuPy's."""
    from kvrt.workers.backend import CupyBackend

    backing = np.zeros(1024, np.uint8)
    mem = SimpleNamespace(ptr=backing.ctypes.data, size=backing.nbytes)
    monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", lambda n: cupy.cuda.PinnedMemoryPointer(mem, 0))
    b = CupyBackend.__new__(CupyBackend)
    b.cp = cupy
    stage = b.host_buffer((3, 2, 4), np.float16)
    assert stage.shape == (3, 2, 4) and stage.dtype == np.float16 and stage.ctypes.data == backing.ctypes.data
    stage[1] = 7
    assert backing.view(np.float16)[8:16].tolist() == [7.0] * 8
