"""What a prefill node and a decode node share about talking to each other: limits on peer
messages and the checks every field of a peer message passes before it touches any state
(the peer is authenticated, but a bug or a hostile peer must fail one request, never the node)."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from kvrt.ipc import protocol as P

log = logging.getLogger("kvrt.runtime.pd")
PEER_CLIENT = b"\x00pd:"  # D: client identity of a peer's requests (ZeroMQ never gives one with \x00)
MAX_PEER_NAME = 64
MAX_REQUEST_ID = 256
MAX_REASON = 512
_PEER_ROOT_DOMAIN = b"kvrt.pd.peer-root.v1\0"


def check_id(rid: object) -> str:
    """The problem with a peer's request id, or ""."""
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        return f"request_id must be a string of 1..{MAX_REQUEST_ID} characters"
    return ""


def peer_key_root(root: bytes, peer: str) -> bytes:
    """The root of the block-key chain of a peer's requests on a decode node: `root` (the
    model's) scoped by the peer's name. D cannot check the KV a peer writes, so what a peer
    wrote is found again only by that peer's later requests, never by D's own clients' or
    another peer's (a cryptographic digest: a peer cannot pick its name to land on a scope
    that is not its own)."""
    return hashlib.sha256(_PEER_ROOT_DOMAIN + root + peer.encode()).digest()[:len(root)]


@dataclass
class Refusals:
    """Counts every refused peer message (in `pd_refused`) and logs it; the process's log
    filter (ipc/log_limit.py) lets one such line out per interval with a count of the rest, so
    a peer sending garbage in a loop cannot fill the disk with the same line."""

    stats: np.ndarray

    def __call__(self, why: str) -> None:
        """Count and log a refused peer message (it changed nothing)."""
        self.stats[P.STAT["pd_refused"]] += 1
        log.warning("peer message refused: %s", why)
