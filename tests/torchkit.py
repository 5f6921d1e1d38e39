"""torch and Triton for a test, or a skip: on a GPU the compiled kernels, on a CPU Triton's
interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets where no NVIDIA device exists, before
any kernel is defined). The default CPU suite installs neither torch nor Triton, so these tests
skip there; the kernels lane installs both (docs/development.md, "Test lanes")."""
from __future__ import annotations

import os
from typing import Any

import pytest


def torch_device() -> tuple[Any, str]:
    """(torch, "cuda" or "cpu"), or skip the caller when torch does not import."""
    torch = pytest.importorskip("torch", reason="the torch backend's tests need torch (the kernels lane)")
    return torch, "cuda" if torch.cuda.is_available() else "cpu"


def triton_device() -> tuple[Any, str]:
    """(torch, device) for running Triton kernels: a GPU, or a CPU under Triton's interpreter;
    a skip when Triton does not import or neither is there."""
    torch, device = torch_device()
    pytest.importorskip("triton", reason="the kernels' tests need Triton (the kernels lane)")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: Triton kernels cannot run here")
    if device == "cpu":
        _scalar_loop_bounds()
    return torch, device


def _scalar_loop_bounds() -> None:
    """Let the interpreter take a loaded value as a loop bound. It holds a scalar as a
    one-element array and makes it an index with int(), which NumPy 2.4 refuses for an array
    of one dimension; the compiled kernels are unaffected, so the fix is the tests' alone."""
    import numpy as np
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "kvrt_scalar_index", False):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched.kvrt_scalar_index = True
    interpreter._patch_lang_tensor = patched
