"""SGLang's router (`pip install sglang-router`) as the peer `kvrt bench route --peer
sglang-router` runs beside `kvrt route`, in front of the same nodes.

Why this peer: it is the cache-aware router a user of these nodes would pick instead (a Rust
binary): it cannot see the nodes' caches and guesses them from the prompts it sent them (a radix
tree per node, of characters), so it is the fair measure of what KV events add. It takes text
prompts only (a prompt of token ids is a 422), so a comparison with it sends text (one byte per
token for the reference model's byte tokenizer) through both routers.
"""
from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kvrt.bench.interrupt import interrupt
from kvrt.ipc.ports import free_port

PEERS = ("sglang-router",)
PEER_POLICY = "cache_aware"


def installed(peer: str) -> bool:
    """Whether the peer's package can be imported here."""
    return peer == "sglang-router" and importlib.util.find_spec("sglang_router") is not None


class PeerRouter:
    """SGLang's router with its cache-aware policy and default settings, in front of `urls`."""

    def __init__(self, urls: list[str]):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvrt-bench-sglang-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *urls, "--policy", PEER_POLICY, "--log-level", "warn",
             # its metrics exporter's own port (by default a fixed one: a second router on the machine would fail)
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        interrupt(self.proc, 20)
        self.log.close()
        if self.proc.returncode in (0, -signal.SIGINT):
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode
