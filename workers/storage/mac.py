"""Storage objects signed by the node group: a MAC keyed by a secret the nodes share.

Why: a storage tier is a place other parties can write to. Anyone who reaches a Mooncake
master or a process lending it memory can put any bytes under any object name, and a file
directory may be written by another process of the same user (or root). A block read back
is fed to the model as the KV of a prompt, so a forged block changes the answers of every
node that reads it. A checksum does not help (the forger computes it too); a MAC keyed by a
secret only the node group holds does.

The MAC is keyed BLAKE3 (32 bytes) over the model/layout identity of the node, the object's
name (block key and rank: an object moved to another name fails) and its bytes. The key is
derived from the secret file's contents in BLAKE3's key-derivation mode with a context of its
own, so the same file could serve another purpose without its MACs being reusable there. Why
BLAKE3 and not the stdlib's BLAKE2b or HMAC-SHA256: every byte a node stores or reads goes
through it, and BLAKE3's SIMD code hashes an order of magnitude faster than either on one core,
which is what keeps a signed read near an unsigned one (`kvrt bench storage`, rows `+mac`). A missing or wrong
MAC makes the object a miss (counted as `storage_forged`, logged through the process's log
filter, ipc/log_limit.py, one line per interval), never a hit; the backend checks it before any byte of the object reaches the
KV pool.
"""
from __future__ import annotations

import hmac

from blake3 import blake3

from kvrt.ipc.config import NodeConfig
from kvrt.ipc.private import read_secret_file
from kvrt.ipc.storage_uri import MAKE_SECRET_HINT

MAC_BYTES = 32
KEY_CONTEXT = "kvrt storage object MAC v1"


class BlockMac:
    """MACs of storage objects for one node group and one model/layout identity."""

    def __init__(self, secret: bytes, identity: bytes):
        self._key = blake3(secret, derive_key_context=KEY_CONTEXT).digest()
        self._identity = len(identity).to_bytes(4, "little") + identity

    def of(self, name: bytes, payload) -> bytes:
        """The MAC of object `name` holding `payload` (any buffer)."""
        h = blake3(self._identity, key=self._key)
        h.update(len(name).to_bytes(4, "little") + name)
        h.update(payload)
        return h.digest(MAC_BYTES)

    def valid(self, name: bytes, payload, mac) -> bool:
        return hmac.compare_digest(self.of(name, payload), bytes(mac))


def node_identity(cfg: NodeConfig) -> bytes:
    """What a block's bytes mean: the model and the KV layout of one rank. (The block keys are
    rooted in the model too; binding it here as well means a key collision across models
    still cannot pass a MAC.)"""
    layout = cfg.kv_layout
    return (f"{cfg.model_arch}|{cfg.model_fingerprint}|seed={cfg.model_seed}|vocab={cfg.vocab_size}|"
            f"{layout.block_shape}|{layout.dtype}|tp={cfg.tp}").encode()


def node_mac(cfg: NodeConfig) -> BlockMac | None:
    """The node's MAC signer, or None when it runs without a storage secret."""
    if not cfg.storage_secret_file:
        return None
    secret = read_secret_file(cfg.storage_secret_file, "--storage-secret-file", MAKE_SECRET_HINT)
    return BlockMac(secret, node_identity(cfg))
