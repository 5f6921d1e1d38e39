"""The storage settings a node refuses at start: a shared store with no secret (unless
--storage-insecure), a secret file others can read or that is too short, a storage directory
of another user or open to others."""
from __future__ import annotations

import os

import pytest

from kvrt.runtime.node.config import ConfigError, NodeConfig

STORE = "mooncake://127.0.0.1:50051"


def secret(tmp_path, text: str = "s" * 64, mode: int = 0o600) -> str:
    path = tmp_path / "store.secret"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_a_shared_store_needs_a_secret_or_insecure(tmp_path):
    with pytest.raises(ConfigError, match="--storage-secret-file.*--storage-insecure"):
        NodeConfig(node="n", storage=STORE).validate()
    NodeConfig(node="n", storage=STORE, storage_insecure=True).validate()
    NodeConfig(node="n", storage=STORE, storage_secret_file=secret(tmp_path)).validate()
    with pytest.raises(ConfigError, match="contradict"):
        NodeConfig(node="n", storage=STORE, storage_secret_file=secret(tmp_path), storage_insecure=True).validate()


@pytest.mark.parametrize("text, mode, error", [("s" * 64, 0o644, "chmod 600"), ("s" * 64, 0o660, "chmod 600"),
                                               ("short", 0o600, "at least 16")])
def test_a_bad_secret_file_is_refused(tmp_path, text, mode, error):
    with pytest.raises(ConfigError, match=error):
        NodeConfig(node="n", storage=STORE, storage_secret_file=secret(tmp_path, text, mode)).validate()


def test_an_unreadable_secret_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        NodeConfig(node="n", storage=STORE, storage_secret_file=str(tmp_path / "missing")).validate()


def test_a_file_tier_needs_no_secret_but_a_private_directory(tmp_path):
    d = tmp_path / "store"
    NodeConfig(node="n", storage=f"file:{d}").validate()  # created later, 0700
    d.mkdir(mode=0o700)
    NodeConfig(node="n", storage=f"file:{d}").validate()
    d.chmod(0o755)
    with pytest.raises(ConfigError, match="mode 755.*chmod 700"):
        NodeConfig(node="n", storage=f"file:{d}").validate()
    if os.geteuid() == 0:
        d.chmod(0o700)
        os.chown(d, 4321, -1)
        with pytest.raises(ConfigError, match="belongs to uid 4321"):
            NodeConfig(node="n", storage=f"file:{d}").validate()


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_node_refuses_a_storage_directory_another_user_made_first(node, tmp_path):
    """Another local user creates the storage directory first (to plant blocks there): `kvrt
    launch` stops at once naming the owner, before it reads any object."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.launched import SMALL

    d = tmp_path / "store"
    d.mkdir(mode=0o700)
    (d / "planted").write_bytes(b"\0" * 64)
    os.chown(d, 4321, 4321)
    r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "launch", "--node", node, *SMALL,
                        "--log-dir", str(tmp_path), "--storage", f"file:{d}"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "belongs to uid 4321" in r.stderr, (r.returncode, r.stderr[-2000:])
