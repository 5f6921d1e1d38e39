"""What a prefill node and a decode node share about talking to each other: limits on peer
messages and the checks every field of a peer message passes before it touches any state
(the peer is authenticated, but a bug or a hostile peer must fail one request, never the node)."""
from __future__ import annotations

import hashlib
import logging
import time
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
    """Counts refused peer messages (every one, in `pd_refused`) and logs them at most `burst`
    per `every_s` seconds, saying how many were left out: a peer sending garbage in a loop
    must not fill the disk with the same line."""

    stats: np.ndarray
    every_s: float = 10.0
    burst: int = 5
    _window_end: float = 0.0
    _logged: int = 0
    _left_out: int = 0

    def __call__(self, why: str) -> None:
        """Count and log a refused peer message (it changed nothing)."""
        self.stats[P.STAT["pd_refused"]] += 1
        now = time.monotonic()
        if now >= self._window_end:
            self._window_end, self._logged = now + self.every_s, 0
        if self._logged >= self.burst:
            self._left_out += 1
            return
        self._logged += 1
        more, self._left_out = self._left_out, 0
        log.warning("peer message refused: %s%s", why, f" ({more} more refused, not logged)" if more else "")
