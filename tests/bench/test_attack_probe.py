"""`kvrt bench attacks`' probe (the other client it times) against a stand-in HTTP server in this
process: a window of any length has at least one timed answer, since the idle figure every row
is divided by is the worst of them."""
from __future__ import annotations

import http.server
import os
import threading

from kvrt.bench.attacks import Probe


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (the handler's name is http.server's)
        self.rfile.read(int(self.headers["content-length"]))
        body = b'{"choices": []}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_window_that_ends_before_the_probe_starts_still_has_its_answer():
    """The window is over before the probe's thread has its HTTP client set up (as on a loaded
    machine with `--idle-s 0.5`): its first request is still sent and timed."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with Probe(f"http://127.0.0.1:{server.server_address[1]}", "m", os.getpid()) as p:
            pass
        assert len(p.times) == 1, "the window had no answer"
        assert p.sent == 1
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
