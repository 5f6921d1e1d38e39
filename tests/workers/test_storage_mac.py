"""Signed storage objects: the MAC binds the secret, the node's identity, the object's name and
its bytes; the file tier serves no object without a valid one (planted with a valid checksum,
unsigned, or signed by another group), counts it, removes it, and never lets its bytes reach
the buffer it reads into; storage directories are private to this user."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.ipc.config import NodeConfig
from kvrt.workers.storage.base import FileStorage, StorageError
from kvrt.workers.storage.mac import BlockMac, node_identity, node_mac

KEY = bytes(range(16))
SECRET, OTHER = b"s" * 32, b"t" * 32


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((2, 2, 4, 8), dtype=np.float32)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=16, max_size=64), st.binary(max_size=16), st.binary(max_size=24), st.binary(max_size=64),
       st.integers(0, 3), st.data())
def test_the_mac_changes_with_every_input(secret, identity, name, payload, which, data):
    mac = BlockMac(secret, identity).of(name, payload)
    assert BlockMac(secret, identity).valid(name, payload, mac)
    other = data.draw(st.binary(max_size=64))
    changed = [(other + b"x", identity, name, payload), (secret, other, name, payload),
               (secret, identity, other, payload), (secret, identity, name, other)][which]
    if changed != (secret, identity, name, payload):
        s, i, n, p = changed
        assert not BlockMac(s, i).valid(n, p, mac)


def test_identity_separates_models_and_layouts():
    a = node_identity(NodeConfig(node="x"))
    assert a == node_identity(NodeConfig(node="y")), "the node's name is not part of what a block means"
    assert a != node_identity(NodeConfig(node="x", tp=2))
    assert a != node_identity(NodeConfig(node="x", model_seed=1))
    assert a != node_identity(NodeConfig(node="x", model_fingerprint="abc"))
    assert a != node_identity(NodeConfig(node="x", dtype="float16"))


def test_node_mac_reads_the_secret_file_and_refuses_a_loose_one(tmp_path):
    assert node_mac(NodeConfig(node="x")) is None
    path = tmp_path / "store.secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    mac = node_mac(NodeConfig(node="x", storage_secret_file=str(path)))
    assert mac.valid(b"n", b"p", BlockMac(SECRET, node_identity(NodeConfig(node="x"))).of(b"n", b"p"))
    path.chmod(0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        node_mac(NodeConfig(node="x", storage_secret_file=str(path)))


def signed(tmp_path, secret: bytes | None = SECRET, rank: int = 0) -> FileStorage:
    return FileStorage(str(tmp_path / "store"), rank, mac=None if secret is None else BlockMac(secret, b"model"))


def test_signed_objects_round_trip(tmp_path):
    s = signed(tmp_path)
    a, out = block(0), np.zeros((2, 2, 4, 8), np.float32)
    s.put(KEY, a)
    assert s.get(KEY, out) and np.array_equal(out, a)
    assert s.forged == s.errors == 0


@pytest.mark.parametrize("planter", ["unsigned", "another secret", "another identity", "another rank's object"])
def test_a_planted_object_with_a_valid_checksum_is_not_served(tmp_path, planter):
    """Whoever else writes into the directory: its checksum is right, its MAC is not ours."""
    victim = signed(tmp_path)
    if planter == "unsigned":
        forger = signed(tmp_path, secret=None)
    elif planter == "another secret":
        forger = signed(tmp_path, secret=OTHER)
    elif planter == "another identity":
        forger = FileStorage(str(tmp_path / "store"), 0, mac=BlockMac(SECRET, b"other model"))
    else:
        forger = signed(tmp_path, rank=1)
    forger.put(KEY, block(1))
    if planter == "another rank's object":  # a genuine object of ours, moved to another name
        os.replace(forger.path(KEY), victim.path(KEY))
    out = np.full((2, 2, 4, 8), 7, np.float32)
    assert victim.get(KEY, out) is False
    assert (out == 7).all(), "no byte of a rejected object reaches the buffer it was read for"
    assert victim.forged == 1 and victim.errors == 0
    assert not victim.contains(KEY), "removed: the real block can be written under its name again"
    victim.put(KEY, block(2))
    assert victim.get(KEY, out) and np.array_equal(out, block(2))


def test_an_unsigned_node_still_reads_signed_objects_by_checksum(tmp_path):
    signed(tmp_path).put(KEY, block(3))
    out = np.zeros((2, 2, 4, 8), np.float32)
    assert signed(tmp_path, secret=None).get(KEY, out) and np.array_equal(out, block(3))


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o720, 0o777])
def test_a_directory_other_users_may_enter_is_refused(tmp_path, mode):
    d = tmp_path / "store"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(StorageError, match="chmod 700"):
        FileStorage(str(d), 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "store"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, -1)
    with pytest.raises(StorageError, match="belongs to uid 12345"):
        FileStorage(str(d), 0)


def test_created_directories_are_private(tmp_path):
    s = FileStorage(str(tmp_path / "a" / "b"), 0)
    s.put(KEY, block(4))
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "00"):
        assert os.stat(d).st_mode & 0o777 == 0o700, d
