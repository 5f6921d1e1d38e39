"""Nodes a benchmark launches for itself: `kvrt launch` in a subprocess, waited for until its
client API answers, always stopped (SIGINT, then SIGKILL and `kvrt clean`)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from kvrt.bench.interrupt import interrupt
from kvrt.ipc.ports import free_port
from kvrt.runtime.client.client import Client, ClientError

REPO = str(Path(__file__).resolve().parents[1])


class LaunchedNode:
    """`kvrt launch` in a subprocess; stopped with SIGINT (then SIGKILL and `kvrt clean`) on exit."""

    def __init__(self, name: str, port: int, launch_args: list[str], say: Callable[[str], None],
                 ready_timeout: float = 60.0, log: Path | None = None):
        self.port = port
        self.name = name
        self.say = say
        self.cmd = [sys.executable, "-m", "kvrt.launcher", "launch", "--node", name, "--port", str(port), *launch_args]
        self._tmp = None
        if log is None:
            self._tmp = tempfile.NamedTemporaryFile("w+", prefix="kvrt-bench-replay-", suffix=".log", delete=False)
            self.log_path = Path(self._tmp.name)
            log = self._tmp
        else:
            self.log_path = log
            log = open(log, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        self.ready_timeout = ready_timeout

    @classmethod
    def ready(cls, name: str, launch_args: list[str], say: Callable[[str], None]) -> "LaunchedNode":
        """A node on a free port, once it answers; stopped again if it never does."""
        node = cls(name, free_port(), launch_args, say)
        try:
            node.wait_ready()
        except RuntimeError:
            node.stop()
            raise
        return node

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    def wait_ready(self) -> None:
        """Until the node answers info(); RuntimeError if it exits or the timeout passes."""
        t0 = time.monotonic()
        next_line = t0 + 2.0
        with Client(self.port, timeout=1.0) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the node exited with code {self.proc.returncode} before answering; "
                                       f"its log ({self.log_path}) ends:\n{self.log_tail()}")
                try:
                    c.info(timeout=0.5)
                    return
                except ClientError:
                    pass
                now = time.monotonic()
                if now - t0 > self.ready_timeout:
                    raise RuntimeError(f"the node did not answer info() on port {self.port} within "
                                       f"{self.ready_timeout:g} s; its log ({self.log_path}) ends:\n{self.log_tail()}")
                if now >= next_line:
                    self.say(f"waiting for node {self.name} on port {self.port} ({now - t0:.0f} s)")
                    next_line = now + 2.0

    def stop(self) -> int | None:
        if not interrupt(self.proc, 30):
            self.say(f"node {self.name} did not stop within 30 s of SIGINT: killed it")
            subprocess.run([sys.executable, "-m", "kvrt.launcher", "clean", "--node", self.name], cwd=REPO,
                           capture_output=True, timeout=60)
        if self._tmp is not None and self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode
