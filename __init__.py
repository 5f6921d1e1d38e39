"""kvrt from Python: the client of a running node and a way to start one.

Programs that drive kvrt should not have to know that the client lives in `kvrt.runtime.client` or
how to supervise `kvrt launch` themselves, so this package is the one stable import:

    import kvrt
    with kvrt.launch(num_gpu_blocks=256) as node:
        print(node.client().generate([1, 2, 3], 8).output_token_ids)
    with kvrt.Client(5555) as c:                 # a node started elsewhere
        c.generate([1, 2, 3], 8, sampling=kvrt.Sampling(temperature=0.7, seed=1))

The names are loaded on first use: every process of a node imports its own modules through this
package, and a worker has no use for the client or the launcher.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrt.runtime.client.client import Client, ClientError, Generation, RequestError, Result, Sampling
    from kvrt.runtime.client.launch import LaunchError, Node, launch

_HOMES = {"Client": "kvrt.runtime.client.client", "ClientError": "kvrt.runtime.client.client",
          "Generation": "kvrt.runtime.client.client", "RequestError": "kvrt.runtime.client.client",
          "Result": "kvrt.runtime.client.client", "Sampling": "kvrt.runtime.client.client",
          "LaunchError": "kvrt.runtime.client.launch", "Node": "kvrt.runtime.client.launch",
          "launch": "kvrt.runtime.client.launch"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    try:
        home = _HOMES[name]
    except KeyError:
        raise AttributeError(f"module 'kvrt' has no attribute {name!r}") from None
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
