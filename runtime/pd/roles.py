"""KV connectors: the one place a node's role decides where KV comes from and goes to.

`connector_class` is the only reader of the role on the engine side; a new connector is one new
module plus one line in `_BY_ROLE`.
"""
from __future__ import annotations

from kvrt.runtime.pd.connector import KVConnector
from kvrt.runtime.pd.decode import DecodeConnector
from kvrt.runtime.pd.prefill import PrefillConnector

_BY_ROLE: dict[str, type[KVConnector]] = {
    "mixed": KVConnector,
    "prefill": PrefillConnector,
    "decode": DecodeConnector,
}


def connector_class(role: str) -> type[KVConnector]:
    """The connector of a node with `role` (NodeConfig has checked the role already). The
    class first: the engine attaches the connector's own rank rings before building it."""
    try:
        return _BY_ROLE[role]
    except KeyError:
        raise ValueError(f"no KV connector for role {role!r} (known: {', '.join(_BY_ROLE)})") from None
