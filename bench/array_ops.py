"""Counting the array operations of one forward step, on NumPy.

Why count rather than time: on a GPU the model runner's step is bound by the cost of launching
its kernels from Python (tens of microseconds each on a busy or virtualised host), not by the
kernels' work, so the number of array operations a step makes predicts its time there. The
step's code is the same on NumPy and CuPy (`xp`), and each operation below launches at least
one kernel on CuPy, so counting them on NumPy needs no GPU: `kvrt bench model --count-ops`.

Counted: each ufunc call (arithmetic, comparisons, `@`, reductions), each array function
(`where`, `concatenate`, `mean`, ...), each fancy index (a gather) or assignment into an array
(a scatter), each cast that makes a copy. Views (reshape, transpose, basic slices) are free.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np


class _Counted(np.ndarray):
    """An ndarray whose operations add to its `counts`, a Counter every array made from it shares."""

    counts: collections.Counter

    def __array_finalize__(self, obj: Any) -> None:
        self.counts = getattr(obj, "counts", None)

    def _wrap(self, out: Any) -> Any:
        if isinstance(out, np.ndarray):
            out = out.view(_Counted)
            out.counts = self.counts
        return out

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        self.counts[ufunc.__name__ + ("" if method == "__call__" else "." + method)] += 1
        inputs = tuple(a.view(np.ndarray) if isinstance(a, _Counted) else a for a in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(a.view(np.ndarray) if isinstance(a, _Counted) else a for a in kwargs["out"])
        return self._wrap(getattr(ufunc, method)(*inputs, **kwargs))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        self.counts[func.__name__] += 1
        return self._wrap(super().__array_function__(func, (np.ndarray,), args, kwargs))

    def __getitem__(self, key: Any) -> Any:
        if any(isinstance(k, np.ndarray) for k in (key if isinstance(key, tuple) else (key,))):
            self.counts["gather"] += 1
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.counts["scatter"] += 1
        super().__setitem__(key, value)

    def astype(self, dtype: Any, copy: bool = True, **kwargs: Any) -> Any:
        if np.dtype(dtype) != self.dtype or copy:
            self.counts["astype"] += 1
        return super().astype(dtype, copy=copy, **kwargs)


def _counted(obj: Any, counts: collections.Counter) -> Any:
    """`obj` with every NumPy array in it (fields of mutable dataclasses, lists, tuples, dict
    values) a view counting into `counts`, in place."""
    if isinstance(obj, np.ndarray):
        view = obj.view(_Counted)
        view.counts = counts
        return view
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not obj.__dataclass_params__.frozen:
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _counted(getattr(obj, f.name), counts))
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_counted(v, counts) for v in obj)
    if isinstance(obj, dict):
        return {k: _counted(v, counts) for k, v in obj.items()}
    return obj


def count_step(model: Any, pool: np.ndarray, seqs: list) -> collections.Counter:
    """The array operations of `model.forward` over `seqs` (the layers: the step's host-side
    preparation and its LM head are not counted), by operation name. The model must be on
    NumPy; its weights are wrapped for the count and left wrapped (use a model of its own)."""
    counts: collections.Counter = collections.Counter()
    for name in ("embed", "lm_head", "final_norm", "inv_freq", "ropes", "layers"):
        if hasattr(model, name):  # a checkpoint's model holds its RoPEs' frequencies in `ropes`
            setattr(model, name, _counted(getattr(model, name), counts))
    inputs = _counted(model.prepare(pool, seqs), counts)
    counts.clear()
    model.forward(_counted(pool, counts), inputs)
    return counts
