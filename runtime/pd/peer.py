"""What a prefill node and a decode node share about talking to each other: limits on peer
messages and the checks every field of a peer message passes before it touches any state
(the peer is authenticated, but a bug or a hostile peer must fail one request, never the node)."""
from __future__ import annotations

import logging

import numpy as np

from kvrt.ipc import protocol as P

log = logging.getLogger("kvrt.runtime.pd")
PEER_CLIENT = b"\x00pd:"  # D: client identity of a peer's requests (ZeroMQ never gives one with \x00)
MAX_PEER_NAME = 64
MAX_REQUEST_ID = 256
MAX_REASON = 512


def check_id(rid: object) -> str:
    """The problem with a peer's request id, or ""."""
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        return f"request_id must be a string of 1..{MAX_REQUEST_ID} characters"
    return ""


def refused(stats: np.ndarray, why: str) -> None:
    """Count and log a refused peer message (it changed nothing)."""
    stats[P.STAT["pd_refused"]] += 1
    log.warning("peer message refused: %s", why)
