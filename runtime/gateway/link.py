"""The private link between the engine and the gateway: who is who, and what crosses it.

Why a link of our own rather than libzmq's proxy: the engine learns that a client is gone or does
not read from its sends failing (ROUTER_MANDATORY: runtime/engine/server.py), and libzmq's proxy
ends at the first send that fails. So the gateway makes those sends itself and tells the engine
what they found, and the two exchange batches of frames over one ipc:// connection in the node's
private socket directory (ipc/sockets.py): one multipart message per batch, its first frame the
kind, then the items' frames back to back.

Identities: the engine knows a client of the gateway as RELAYED + its routing id at the gateway's
public socket, and a prefill node's decode peer as PEER + its index (the gateway keeps those
sockets too); any other identity is a client of the engine's own private socket (the HTTP
server's bridge). RELAYED is a byte no ZeroMQ-made identity starts with and PEER starts with one
no client can choose through the gateway, so no public client can pass for either kind.

Up (gateway -> engine):  MESSAGES client, data, ...  (one frame each: counted in the window)
                         FRAMES   client, count, ...  (a message of `count` frames: counted too)
                         PEERS    peer, data, ...     (from decode peers: never held back)
                         NOTICES  client, kind, ...   (GONE or OVERFLOW, found by the gateway's sends)
Down (engine -> gateway): ANSWERS  credit, client, data, keep, ...  (keep: KEEP or b"")
                          CREDIT   credit

The window: the gateway reads its public socket only while fewer than WINDOW counted messages
it sent wait for the engine to take them in. So the rest of a flood waits in libzmq's queue of
each public connection, which its socket serves fair-queued, as the engine's own socket did
before the gateway: a well-behaved client's message waits behind at most the engine's inbox and
one window. `credit` is how many more counted messages the engine took in since it last said;
it says so with its next answers, or on its own once it owes half a window (a message of its
own per message taken would wake the gateway once more per request).
"""
from __future__ import annotations

MESSAGES, FRAMES_UP, PEERS, NOTICES = b"m", b"f", b"p", b"n"
ANSWERS, CREDIT = b"a", b"c"
KEEP = b"k"  # keep this answer for a client that does not read (runtime/engine/server.py)
WINDOW = 64  # counted messages the gateway may have sent that the engine has not taken in

RELAYED = b"\x01"  # first byte of the engine's identity of a gateway client
PEER = b"\x00peer!"  # first bytes of the identities of a prefill node's decode peers

# what the engine is told about a client (runtime/engine/server.py ClientNotice.kind)
GONE = "gone"          # its connection is closed: its requests can be cancelled
OVERFLOW = "overflow"  # its answers wait unread past its queue: its requests must be cancelled
FRAMES = "frames"      # it sent a message of several frames, not one


def peer_identity(index: int) -> bytes:
    """The identity of decode peer `index` (its place in --decode-peer) on a prefill node."""
    return PEER + str(index).encode()


def relayed(client: bytes) -> bool:
    """Whether the engine reaches `client` through the gateway."""
    return client[:1] == RELAYED or client.startswith(PEER)


def pairs(frames: list[bytes], width: int = 2, head: int = 1) -> list[tuple[bytes, ...]]:
    """A batch's items: its frames after the `head` ones (the kind, the credit), `width` at a
    time (a short last item is dropped: both ends are ours, so it is a bug, never input)."""
    body = frames[head:]
    return [tuple(body[i:i + width]) for i in range(0, len(body) - width + 1, width)]


def count(frame: bytes) -> int:
    """A count frame's value (decimal ASCII); 0 for anything else."""
    return int(frame) if frame.isdigit() and len(frame) <= 9 else 0
