"""kvrt from Python: the client of a running node and a way to start one.

Programs that drive kvrt should not have to know that the client lives in `runtime.client` or
how to supervise `kvrt launch` themselves, so this package is the one stable import:

    import kvrt
    with kvrt.launch(num_gpu_blocks=256) as node:
        print(node.client().generate([1, 2, 3], 8).output_token_ids)
    with kvrt.Client(5555) as c:                 # a node started elsewhere
        c.generate([1, 2, 3], 8, sampling=kvrt.Sampling(temperature=0.7, seed=1))
"""
from __future__ import annotations

from kvrt.node import LaunchError, Node, launch
from runtime.client import Client, ClientError, Generation, RequestError, Result, Sampling

__all__ = ["Client", "ClientError", "Generation", "LaunchError", "Node", "RequestError", "Result",
           "Sampling", "launch"]
