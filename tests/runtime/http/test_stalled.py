"""An answer to a client that reads nothing (runtime/http/stalled.py): once a write has waited
its bound the connection is dropped (the server's hook), the answer's generator is closed (which
cancels its requests) and the answer is never completed; a client that reads gets all of it."""
from __future__ import annotations

import asyncio

from kvrt.runtime.http.connections import ABORT
from kvrt.runtime.http.stalled import CutWhenStalled


def _serve(blocked_after: int | None) -> tuple[list[dict], bool, bool]:
    """The messages sent, whether the connection was dropped and whether the generator's
    `finally` ran, for a client that stops reading after `blocked_after` body writes."""
    closed = []

    async def body():
        try:
            for i in range(10):
                yield f"piece {i}\n"
        finally:
            closed.append(True)

    async def go() -> tuple[list[dict], bool]:
        sent: list[dict] = []
        gone = asyncio.Event()

        async def send(msg: dict) -> None:
            if blocked_after is not None and sum(m["type"] == "http.response.body" for m in sent) >= blocked_after:
                await gone.wait()  # a transport paused until the connection is lost
                return
            sent.append(msg)

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "client": ("10.0.0.1", 5), ABORT: gone.set}
        await CutWhenStalled(body(), stall_s=0.2, media_type="text/plain")(scope, receive, send)
        return sent, gone.is_set()

    sent, dropped = asyncio.run(go())
    return sent, dropped, bool(closed)


def test_a_client_that_stops_reading_is_cut_and_one_that_reads_gets_everything():
    sent, dropped, closed = _serve(blocked_after=3)
    assert dropped and closed
    assert [m.get("more_body") for m in sent if m["type"] == "http.response.body"] == [True, True, True]
    sent, dropped, closed = _serve(blocked_after=None)
    assert not dropped and closed
    assert b"".join(m.get("body", b"") for m in sent) == "".join(f"piece {i}\n" for i in range(10)).encode()
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
