"""Which transport a node's P->D link uses: the one place that knows every kind, so the
interface (`base.py`) that each kind implements imports none of them."""
from __future__ import annotations

from typing import Any

from kvrt.workers.backend import Pool
from kvrt.workers.transports.base import TRANSPORTS, Endpoint, Transport


def open_transport(kind: str, pool: Pool, local: Endpoint, **options: Any) -> Transport:
    """Open a transport of `kind` ("shm" or "mooncake") over this rank's device `pool`.

    `local` names this end (for mooncake also the address peers reach it at). Options: mooncake takes `protocol` ("tcp"
    or "rdma"), `device` (RDMA NIC filter), `timeout_s`, `connect_timeout_s`; shm takes
    `liveness_interval_s`."""
    if kind == "shm":
        from kvrt.workers.transports.shm import ShmTransport

        return ShmTransport(pool, local, **options)
    if kind == "mooncake":
        from kvrt.workers.transports.mooncake import MooncakeTransport

        return MooncakeTransport(pool, local, **options)
    raise ValueError(f"unknown transport {kind!r}: expected one of {', '.join(TRANSPORTS)}")
