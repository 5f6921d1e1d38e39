"""KV connectors: the one place a node's role decides where KV comes from and goes to.

`make_connector` is the only reader of the role on the engine side; a new connector is one new
module plus one line in `_BY_ROLE`.
"""
from __future__ import annotations

from .base import ConnectorContext, KVConnector, SchedulerHooks, SchedulerVerbs
from .decode import DecodeConnector
from .prefill import PrefillConnector

__all__ = ["ConnectorContext", "KVConnector", "SchedulerHooks", "SchedulerVerbs", "make_connector"]

_BY_ROLE: dict[str, type[KVConnector]] = {
    "mixed": KVConnector,
    "prefill": PrefillConnector,
    "decode": DecodeConnector,
}


def make_connector(role: str, ctx: ConnectorContext) -> KVConnector:
    """The connector of a node with `role` (NodeConfig has checked the role already)."""
    try:
        return _BY_ROLE[role](ctx)
    except KeyError:
        raise ValueError(f"no KV connector for role {role!r} (known: {', '.join(_BY_ROLE)})") from None
