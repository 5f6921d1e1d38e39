"""The messages between a prefill engine (P) and a decode engine (D), on D's client socket.

They share the client API's codec (runtime/client/api.py) because D reads them from the socket its
clients use; a user's client never sends or receives them.

P -> D: PdHello; D -> P: PdWelcome (runtime/pd/auth.py). Then every message either way is inside
a PdSealed of that session:
P -> D: PdPrealloc, then PdKvReady or PdAbort (and CancelRequest, relayed from P's client);
        PdPing while idle.
D -> P: PdAllocated or ErrorEvent, then TokenEvent* and FinishedEvent, which P relays; PdPong.
D answers a sealed message it cannot open with PdRefused (in clear: P then says hello again).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvrt.runtime.client.api import API, Generation


@API.message("pd_hello")
@dataclass
class PdHello:
    """P -> D, in clear: open a session for peer `peer` (P's node name)."""

    peer: str
    nonce: bytes


@API.message("pd_welcome")
@dataclass
class PdWelcome:
    """D -> P, in clear: the new session; `mac` proves D holds the shared secret."""

    nonce: bytes
    session: bytes
    mac: bytes


@API.message("pd_sealed")
@dataclass
class PdSealed:
    """An authenticated peer message: `body` is a message encoded with the client API's codec."""

    session: bytes
    counter: int
    body: bytes
    mac: bytes


@API.message("pd_refused")
@dataclass
class PdRefused:
    """D -> P, in clear: a peer message was refused (unknown session, bad signature)."""

    session: bytes
    reason: str


@API.message("pd_ping")
@dataclass
class PdPing:
    """P -> D, sealed: are you there? (P notices a dead D without waiting --pd-timeout)."""

    nonce: int = 0


@API.message("pd_pong")
@dataclass
class PdPong:
    """D -> P, sealed: here; `free_blocks`: blocks D could give this peer now (-1: not said),
    which P uses to pick among several decode nodes."""

    nonce: int = 0
    free_blocks: int = -1


@API.message("pd_prealloc")
@dataclass
class PdPrealloc(Generation):
    """P asks D to hold blocks for a request's prompt (D matches its own prefix cache first:
    only blocks past `cached_tokens` of D's answer travel). The sampling parameters are the
    request's (P already picked the seed). `wait`: when the peer is over its share of D's
    pool, D queues the request until blocks come back (bounded by its lease); False: D
    refuses it at once instead (P has another decode node to ask)."""

    wait: bool = True


@API.message("pd_allocated")
@dataclass
class PdAllocated:
    """D's answer: its block ids for the prompt (in token order), the prompt tokens it already
    has, how each of its ranks is reached (transport descriptors), and how long it holds the
    blocks before taking them back (the lease). For a model of several layer groups, `group_ids`
    holds D's pages of the other groups, group after group, as many as `block_ids` each: -1 for
    a block D needs no page of (before a sliding group's window, which D never reads)."""

    request_id: str
    block_ids: np.ndarray
    cached_tokens: int
    descriptors: list
    lease_s: float
    free_blocks: int = -1  # as in PdPong, once these blocks are taken
    waited_s: float = 0.0  # how long D kept the request queued before it allocated: the lease began that late
    group_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))


@API.message("pd_kv_ready")
@dataclass
class PdKvReady:
    """P -> D: every rank wrote the blocks; the request continues on D after `first_token`
    (`first_logprob`: its log-probability, if the request asked; `first_top`: its alternatives,
    [ids, logprobs], if the request asked)."""

    request_id: str
    first_token: int
    first_logprob: float = 0.0
    first_top: list = field(default_factory=list)


@API.message("pd_abort")
@dataclass
class PdAbort:
    """P -> D: give the request's blocks back now (P failed or the client cancelled)."""

    request_id: str
    reason: str = ""
