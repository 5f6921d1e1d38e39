"""Start a kvrt node from Python: `kvrt launch` in a subprocess, supervised by a context manager.

The node runs as its own process tree (as `kvrt launch` does on the command line) rather than
inside the caller, because its processes share memory through POSIX objects and stop on SIGINT:
keeping the caller out of that tree means a crash or a Ctrl-C in a notebook never leaves a
half-stopped node behind it, and the node behaves exactly as the CLI documents.

Flags are given as keyword arguments, turned into `kvrt launch` flags, and checked by the
launcher's own parser before anything starts, so a typo is a ValueError here, not a node that
exits a second later.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from typing import NoReturn

import psutil

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.client import Client, ClientError
from kvrt.runtime.node.supervisor import child_command

log = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT = 120.0  # a node with a checkpoint to map may take a while on a loaded machine
DEFAULT_STOP_TIMEOUT = 60.0
_KILL_WAIT = 10.0  # seconds for SIGKILLed processes to be gone: the kernel's part, not the node's
_LOG_TAIL = 4000  # characters of the node's output quoted in an error


class LaunchError(RuntimeError):
    """The node did not come up (or did not stop); the message names what was awaited and ends
    with the tail of the node's output."""


class _ParseError(ValueError):
    pass


class _RaisingParser(argparse.ArgumentParser):
    """The launcher's parser, raising instead of printing usage and exiting the caller's process."""

    def error(self, message: str) -> NoReturn:
        raise _ParseError(message)


def launch_argv(flags: Mapping[str, object]) -> list[str]:
    """`kvrt launch` flags for keyword arguments: `num_gpu_blocks=256` -> `--num-gpu-blocks 256`,
    `True` -> the bare switch, `False`/`None` -> left out (the launcher's default)."""
    argv: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def check_launch_argv(argv: list[str]) -> argparse.Namespace:
    """Parse `argv` as `kvrt launch` would; ValueError naming the bad flag otherwise."""
    from kvrt import launcher  # the flags' one definition; it sits above runtime/, so not at import

    parser = _RaisingParser(prog="kvrt")
    launcher._add_launch(parser.add_subparsers(dest="command"))  # subparsers inherit the class
    try:
        return parser.parse_args(["launch", *argv])
    except _ParseError as e:
        raise ValueError(f"kvrt launch {' '.join(argv)}: {e}") from None


class Node:
    """A running `kvrt launch` process and its client API address. Use as a context manager (or
    call stop()): the node is stopped with SIGINT, as on the command line, so it finishes
    in-flight work and removes its shared memory."""

    def __init__(self, argv: list[str], name: str, port: int, host: str, *,
                 start_timeout: float = DEFAULT_START_TIMEOUT, stop_timeout: float = DEFAULT_STOP_TIMEOUT,
                 env: Mapping[str, str] | None = None):
        self.name = name
        self.port = port
        self.host = host
        self.stop_timeout = stop_timeout
        self.returncode: int | None = None
        self._clients: list[Client] = []
        self._dir = tempfile.mkdtemp(prefix="kvrt-node-")  # 0700: the node's output, until stop()
        self._out_path = os.path.join(self._dir, "launch.log")
        out = open(self._out_path, "wb")
        try:
            # As the launcher starts its children: kvrt's own modules, whatever the caller's working
            # directory holds. Its own session: a Ctrl-C meant for the caller must not stop the
            # node behind stop()'s back.
            self._proc = subprocess.Popen(child_command("kvrt.launcher", ["launch", *argv]),
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, **(env or {})}, start_new_session=True)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        finally:
            out.close()
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self._kill()
            raise

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def client(self, timeout: float = 60.0) -> Client:
        """A new client connected to this node; closed by stop() if the caller has not."""
        c = Client(self.address, timeout=timeout)
        self._clients.append(c)
        return c

    def log_tail(self, chars: int = _LOG_TAIL) -> str:
        """The end of what `kvrt launch` printed (its progress and, without --log-dir, its
        processes' logs)."""
        try:
            with open(self._out_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> int:
        """SIGINT, then wait up to `stop_timeout` s for the node to finish its in-flight work and
        exit; returns its exit status. LaunchError if it does not exit in time (it is then
        killed and its shared memory reclaimed, so nothing is left either way)."""
        for c in self._clients:
            c.close()
        self._clients.clear()
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                tail = self.log_tail()
                self._kill()
                raise LaunchError(f"node {self.name} did not exit within {self.stop_timeout:g} s of SIGINT "
                                  f"(killed); its output ended with:\n{tail}") from None
        self.returncode = self._proc.returncode
        if self.returncode != 0:
            log.warning("node %s exited with %s; its output ended with:\n%s", self.name, self.returncode,
                        self.log_tail())
        shutil.rmtree(self._dir, ignore_errors=True)
        return self.returncode

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.address!r}, pid={self._proc.pid}, alive={self.alive()})"

    # ---- internals ---------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> None:
        """Until the node answers an info request on its client API: that is sent once every
        process is ready, so the first request after this is served, not queued behind start-up."""
        deadline = time.monotonic() + timeout
        with Client(self.address, timeout=timeout) as probe:
            while True:
                if self._proc.poll() is not None:
                    raise LaunchError(f"kvrt launch for node {self.name} exited with {self._proc.returncode} "
                                      f"before answering on {self.address}; its output ended with:\n"
                                      f"{self.log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LaunchError(f"node {self.name} did not answer an info request on {self.address} "
                                      f"within {timeout:g} s; its output ended with:\n{self.log_tail()}")
                try:
                    probe.info(timeout=min(0.5, left))
                    return
                except ClientError:
                    continue

    def _kill(self) -> None:
        """SIGKILL the node's whole process tree and reclaim its shared memory: the path for a
        node that did not come up or would not stop, where SIGINT cannot be relied on."""
        from kvrt.ipc.errors import NodeLive
        from kvrt.ipc.registry import reclaim

        for c in self._clients:
            c.close()
        self._clients.clear()
        try:  # the launcher starts each child in a session of its own: walk the tree, not a group
            tree = psutil.Process(self._proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        self._proc.kill()
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        self._proc.wait(timeout=_KILL_WAIT)
        _, alive = psutil.wait_procs(tree, timeout=_KILL_WAIT)
        self.returncode = self._proc.returncode
        if alive:
            log.error("node %s: processes %s survived SIGKILL", self.name, [p.pid for p in alive])
        try:
            reclaim(self.name)
        except NodeLive as e:  # a process survived SIGKILL and still holds it: say so, keep it
            log.error("node %s: shared memory not reclaimed: %s", self.name, e)
        shutil.rmtree(self._dir, ignore_errors=True)


def launch(model: str | os.PathLike | None = None, port: int | None = None, *,
           start_timeout: float = DEFAULT_START_TIMEOUT, stop_timeout: float = DEFAULT_STOP_TIMEOUT,
           env: Mapping[str, str] | None = None, **flags: object) -> Node:
    """Start a node and return once it answers on its client API.

    `model`: a Hugging Face checkpoint directory (default: the built-in reference model);
    `port`: the client API port (default: a free one); `flags`: any other `kvrt launch` option,
    e.g. `num_gpu_blocks=256, tp=2, log_dir="logs"`. ValueError for a flag the launcher refuses
    (nothing is started); LaunchError, with the node's output, if it does not come up within
    `start_timeout` s."""
    if flags.get("demo"):
        raise ValueError("demo=True runs a workload and stops the node: use `kvrt launch --demo`")
    host = str(flags.get("host") or "127.0.0.1")
    if port == 0:
        raise ValueError("port=0 means no client API, so the node could not be reached: leave port out "
                         "for a free one")
    port = port if port is not None else free_port(host)
    name = str(flags.pop("node", None) or f"kvrt{port}")
    if model is not None:
        flags["model"] = os.path.abspath(os.fspath(model))
    argv = ["--node", name, "--port", str(port), *launch_argv(flags)]
    check_launch_argv(argv)
    connect = "127.0.0.1" if host in ("0.0.0.0", "*") else host  # a wildcard listens on loopback too
    return Node(argv, name, port, connect, start_timeout=start_timeout, stop_timeout=stop_timeout, env=env)
