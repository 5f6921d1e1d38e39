"""CuPy with a CUDA device, or a skip: what every GPU test starts with (CI has no GPU; the
command that runs these tests on a GPU machine is in docs/development.md, "GPU validation")."""
from __future__ import annotations

from typing import Any

import pytest


def cuda_cupy() -> Any:
    """The cupy module, or skip the caller (a test, or a whole module at import) when CuPy does
    not import or sees no CUDA device."""
    cupy = pytest.importorskip("cupy")
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        gpus = 0
    if gpus == 0:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cupy
