"""A node's children import kvrt's own modules whatever the working directory holds: a user
who runs `kvrt launch` from a folder with their own `workers/`, `runtime/` or `ipc/` package
must not have it imported into the node's processes, nor a `kvrt/` folder of their own."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kvrt.runtime.client.client import Client, ClientError
from kvrt.ipc.ports import free_port
from tests.launched import SMALL

pytestmark = pytest.mark.e2e

TRAP = """import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sprung"), "a").write(__name__ + "\\n")
raise SystemExit(97)
"""

# what the installed `kvrt` console script is: its own folder, not the cwd, is sys.path[0]
KVRT_SCRIPT = "import sys\nfrom kvrt.launcher import main\nsys.exit(main())\n"


def test_children_ignore_packages_in_the_working_directory(node, tmp_path):
    cwd = tmp_path / "project"
    for pkg in ("workers", "runtime", "ipc", "kvrt"):
        (cwd / pkg).mkdir(parents=True)
        (cwd / pkg / "__init__.py").write_text(TRAP)
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "kvrt"
    script.write_text(KVRT_SCRIPT)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), "launch", "--node", node, "--port", str(port),
                             "--num-gpu-blocks", "16", *SMALL], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = Client(port, timeout=30)
    try:
        info = None
        while proc.poll() is None and info is None:
            try:
                info = client.info(timeout=0.5)
            except ClientError:
                pass
        assert info is not None, f"the node never answered; kvrt launch exited {proc.returncode}"
        assert client.generate([1, 2, 3], 2).num_output_tokens == 2
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert not (cwd / "sprung").exists(), f"a child imported the cwd's {(cwd / 'sprung').read_text()!r}"
    assert proc.returncode == 0, out
