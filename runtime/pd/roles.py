"""KV connectors: the one place a node's role decides where KV comes from and goes to.

`connector_class` is the only reader of the role on the engine side; a new connector is one new
module plus one line in `_BY_ROLE`. Each is imported when its role is asked for: a mixed node's
engine (most nodes) never loads the prefill and decode sides (their sessions, their crypto).
"""
from __future__ import annotations

import importlib

from kvrt.runtime.pd.connector import KVConnector

_BY_ROLE: dict[str, tuple[str, str]] = {  # role -> (module, class)
    "mixed": ("kvrt.runtime.pd.connector", "KVConnector"),
    "prefill": ("kvrt.runtime.pd.prefill", "PrefillConnector"),
    "decode": ("kvrt.runtime.pd.decode", "DecodeConnector"),
}


def connector_class(role: str) -> type[KVConnector]:
    """The connector of a node with `role` (NodeConfig has checked the role already). The
    class first: the engine attaches the connector's own rank rings before building it."""
    try:
        module, name = _BY_ROLE[role]
    except KeyError:
        raise ValueError(f"no KV connector for role {role!r} (known: {', '.join(_BY_ROLE)})") from None
    return getattr(importlib.import_module(module), name)
