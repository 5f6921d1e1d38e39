"""Authentication of the prefill/decode peer link: a shared secret, HMAC-SHA256 sessions.

Why HMAC over each message rather than ZeroMQ CURVE + ZAP: D's peer messages arrive on its
client API socket, which plain clients (`kvrt generate`, runtime.client.client) also use without any
key; CURVE is a per-socket setting and would lock them out or need a second port and a key
pair per node. A shared secret file is one thing to deploy on both machines, and the stdlib's
`hmac` needs no libsodium. What it gives: only holders of the secret can open a session or
send a peer message; each message is bound to its session and direction and carries a counter
that must grow, so a captured message cannot be replayed, reflected or moved to another
session. What it does not give: confidentiality (prompts travel in clear, as client requests
do) and distinction between holders of the same secret (a peer's name is what it claims).

The handshake: P sends PdHello(peer name, nonce_p); D answers PdWelcome(session, mac) with a
fresh random session id, mac = HMAC(secret, "welcome" | nonce_p | session | peer), which proves
D holds the secret. Both derive key = HMAC(secret, "session" | nonce_p | session | peer). Every
later message either way is PdSealed(session, counter, body, mac) with
mac = HMAC(key, direction | session | counter | body); the first sealed message from P proves
P holds the secret.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

from kvrt.ipc.codec import MAX_DEPTH
from kvrt.ipc.errors import ProtocolError
from kvrt.ipc.private import check_secret_length, read_secret_file

from kvrt.runtime.client import api
from kvrt.runtime.pd import messages as wire

SECRET_ENV = "KVRT_PD_SECRET"
NONCE_BYTES = 16
P2D, D2P = b"p2d", b"d2p"
MAKE_SECRET_HINT = ("make one with `python -c 'import secrets; print(secrets.token_hex(32))' > pd.secret && "
                    "chmod 600 pd.secret` and give the same file to both nodes (--pd-secret-file) or put its "
                    f"text in ${SECRET_ENV}")


class AuthError(ProtocolError):
    """A peer message that is not authentic (bad MAC, unknown session, replayed counter)."""


def load_secret(path: str) -> bytes:
    """The shared secret from `path`, else from $KVRT_PD_SECRET; ValueError saying how to make
    one when there is none or it is too short (a short secret can be guessed offline from one
    captured handshake)."""
    if path:
        return read_secret_file(path, "--pd-secret-file", MAKE_SECRET_HINT)
    secret = os.environ.get(SECRET_ENV, "").strip().encode()
    if not secret:
        raise ValueError(f"prefill and decode nodes need a shared secret (--pd-secret-file or "
                         f"${SECRET_ENV}); {MAKE_SECRET_HINT}")
    check_secret_length(secret, f"${SECRET_ENV}", MAKE_SECRET_HINT)
    return secret


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def welcome_mac(secret: bytes, nonce: bytes, session: bytes, peer: str) -> bytes:
    return hmac.new(secret, b"welcome|" + nonce + session + peer.encode(), hashlib.sha256).digest()


def session_key(secret: bytes, nonce: bytes, session: bytes, peer: str) -> bytes:
    return hmac.new(secret, b"session|" + nonce + session + peer.encode(), hashlib.sha256).digest()


@dataclass
class Session:
    """One authenticated peer link: its key, and a counter per direction."""

    session: bytes
    key: bytes
    peer: str
    sends: bytes           # the direction this end sends (P2D on P, D2P on D)
    sent: int = 0          # last counter this end used
    received: int = 0      # highest counter accepted from the other end

    def _mac(self, direction: bytes, counter: int, body: bytes) -> bytes:
        return hmac.new(self.key, direction + self.session + counter.to_bytes(8, "little") + body,
                        hashlib.sha256).digest()

    def seal(self, msg) -> wire.PdSealed:
        body = api.API.encode(msg)
        self.sent += 1
        return wire.PdSealed(self.session, self.sent, body, self._mac(self.sends, self.sent, body))

    def open(self, sealed: wire.PdSealed):
        """The inner message of `sealed`, or AuthError (which changes nothing here)."""
        if sealed.session != self.session:
            raise AuthError("sealed message of another session")
        counter = sealed.counter
        if not isinstance(counter, int) or isinstance(counter, bool) or not 0 < counter < 1 << 63:
            raise AuthError(f"bad counter {counter!r}")
        if not isinstance(sealed.body, bytes) or not isinstance(sealed.mac, bytes):
            raise AuthError("body and mac must be bytes")
        theirs = D2P if self.sends == P2D else P2D
        if not hmac.compare_digest(self._mac(theirs, counter, sealed.body), sealed.mac):
            raise AuthError("bad message authentication code")
        if counter <= self.received:
            raise AuthError(f"replayed message (counter {counter}, already at {self.received})")
        msg = api.API.decode(sealed.body, max_depth=MAX_DEPTH)  # ProtocolError if malformed: nothing changed yet
        if isinstance(msg, (wire.PdSealed, wire.PdHello, wire.PdWelcome, wire.PdRefused)):
            raise AuthError(f"{type(msg).__name__} cannot be sealed")
        self.received = counter
        return msg


def check_bytes(value, n: int, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != n:
        raise AuthError(f"{what} must be {n} bytes")
    return value
