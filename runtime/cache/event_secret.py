"""The KV events' deployment secret: who may read a node's events, and what the keys in them are.

Why: the events name every block a node holds by its block key, and a block key is a public
function of the prompt (runtime/cache/keys.py: chained xxh3 from a root that any client reads on
`GET /kvrt/cache`). Whoever reads the stream could hash guessed prompts and see which of them
some user sent: a prompt oracle. One secret (`--events-secret-file`, the same file on the nodes
and on `kvrt route`) closes it twice:

- Access. The PUB and replay sockets are ZeroMQ CURVE servers, and a ZAP handler (pyzmq's
  ThreadAuthenticator) admits one client key only. The server's and the subscribers' key
  pairs are derived from the secret (BLAKE2b with a personalisation per key; X25519 takes any
  32 bytes as a secret key). CURVE rather than ZAP PLAIN with the secret as a token: PLAIN sends
  the token in clear on every connection and the events after it in clear too; CURVE proves that
  the subscriber holds the secret without sending it and encrypts the stream. libzmq's CURVE
  (libsodium) is the only cryptography here; the secret only seeds its keys.
- Blindness. The published keys are BLAKE2b of the node's internal keys, keyed with a key
  derived from the secret, 16 bytes like the internal ones (vLLM's consumers decode them as
  before), so a reader of the stream who lacks the secret (a capture, a consumer given access
  to the socket) cannot tell which prompt a key belongs to. The router holds the secret: it
  computes a prompt's internal keys and maps them the same way (`publish`).

Without a secret the events are open to whoever reaches the port and carry the internal keys:
the node accepts that on a loopback `--host` only (`needs_secret`).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import zmq
from zmq.utils import z85

from kvrt.ipc.private import read_secret_file
from kvrt.runtime.cache.keys import KEY_BYTES

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

PUBLISHED_MEMO = 1 << 16  # keys whose published form is kept (some 15 MB at most)
MAKE_SECRET_HINT = ("make one with `python -c 'import secrets; print(secrets.token_hex(32))' > events.secret && "
                    "chmod 600 events.secret` and give the same file to every node (--events-secret-file) and to "
                    "kvrt route (--events-secret-file)")


def read_secret(path: str) -> bytes:
    """The secret in `path`; ValueError saying what is wrong when it cannot be read, is readable
    by other users, or is too short to resist guessing (ipc/private.py, as every secret file)."""
    return read_secret_file(path, "--events-secret-file", MAKE_SECRET_HINT)


def is_loopback(host: str) -> bool:
    """`host` names this machine's loopback interface only (a name other than localhost is
    taken as reachable from outside: it may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def needs_secret(host: str) -> bool:
    """Events published on `host` need a secret: anything beyond loopback is reachable by others."""
    return not is_loopback(host)


def _derive(secret: bytes, label: bytes, size: int) -> bytes:
    return hashlib.blake2b(secret, digest_size=size, person=label).digest()


class _OneKey:
    """The ZAP credentials check: the subscribers' public key, and nothing else."""

    def __init__(self, allowed: bytes) -> None:
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._allowed)


@dataclass(frozen=True)
class EventSecret:
    """The keys one deployment secret gives: CURVE key pairs (Z85, as libzmq takes them) for
    the publisher and for subscribers, and the key of the published keys' hash."""

    server_public: bytes
    client_public: bytes
    server_secret: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)
    salt_key: bytes = field(repr=False)
    # BLAKE2b already keyed with salt_key: a copy per key skips hashing the key block again (half the time)
    _keyed: "hashlib._Hash" = field(init=False, repr=False, compare=False)
    # published forms of recent keys: a block is published when stored and again when removed, and
    # a router maps the same prefixes (system prompts) for request after request
    _memo: Callable[[bytes], bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_keyed", hashlib.blake2b(digest_size=KEY_BYTES, key=self.salt_key))
        object.__setattr__(self, "_memo", functools.lru_cache(maxsize=PUBLISHED_MEMO)(self._hash))

    @classmethod
    def of(cls, secret: bytes) -> "EventSecret":
        """The keys of `secret`; ValueError when this libzmq has no CURVE (built without libsodium)."""
        if not zmq.has("curve"):
            raise ValueError(f"--events-secret-file needs ZeroMQ's CURVE, which this libzmq "
                             f"({zmq.zmq_version()}) was built without: install pyzmq's own wheel")
        server = z85.encode(_derive(secret, b"kvrt.kv-ev.srv", 32))
        client = z85.encode(_derive(secret, b"kvrt.kv-ev.sub", 32))
        return cls(server_public=zmq.curve_public(server), client_public=zmq.curve_public(client),
                   server_secret=server, client_secret=client, salt_key=_derive(secret, b"kvrt.kv-ev.salt", 64))

    @classmethod
    def load(cls, path: str) -> "EventSecret":
        """From `--events-secret-file PATH` (ValueError as `read_secret` and `of`)."""
        return cls.of(read_secret(path))

    def publish(self, key: bytes) -> bytes:
        """The published form of an internal block key: BLAKE2b(key) keyed with `salt_key`."""
        return self._memo(key)

    def _hash(self, key: bytes) -> bytes:
        h = self._keyed.copy()
        h.update(key)
        return h.digest()

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it binds) a CURVE server with this deployment's key."""
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def subscribe(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it connects) a CURVE client that the publisher admits."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public

    def authenticator(self, ctx: zmq.Context) -> ThreadAuthenticator:
        """A started ZAP handler on `ctx` that admits this deployment's subscribers only
        (stop() it before the context is terminated). Imported here: pyzmq's authenticator
        brings asyncio, which every process that imports this module (the engine, the gateway)
        would otherwise load at start even when it serves its events without a secret."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", _OneKey(self.client_public))
        return auth
