"""Per-HTTP-client quotas on a real node: every HTTP client of a node shares the HTTP server's
one engine client, and each request names the HTTP client it is for, so that the engine's quota
of requests in flight is per HTTP client (its address), as it is per socket on the ZeroMQ path:
client A bursting past its quota gets 429s, and client B (another address) is served meanwhile."""
from __future__ import annotations

import asyncio

import httpx2
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.api import MAX_REQUESTS_PER_CLIENT
from tests.launched import SMALL, launched, oracle
from tests.runtime.http.test_http import MODEL, _wait_healthy

pytestmark = pytest.mark.e2e

BATCH = 64  # prompts in one request (the most one takes)


def _client(address: str) -> httpx2.AsyncClient:
    """An HTTP client whose connections come from `address` (all of 127/8 is this machine)."""
    return httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(local_address=address), timeout=120)


async def _burst_then_other(base: str) -> tuple[list[int], httpx2.Response]:
    """A sends enough long requests to pass its quota; once one of them is refused, B asks."""
    bursts = MAX_REQUESTS_PER_CLIENT // BATCH + 1
    async with _client("127.0.0.1") as a, _client("127.0.0.2") as b:
        tasks = [asyncio.ensure_future(a.post(base + "/v1/completions", json={
            "model": MODEL, "prompt": [[i, j, 1] for j in range(BATCH)], "max_tokens": 3000, "ignore_eos": True}))
            for i in range(bursts)]
        refused: list[int] = []
        pending = set(tasks)
        while not refused and pending:
            done, pending = await asyncio.wait(pending, timeout=120, return_when=asyncio.FIRST_COMPLETED)
            assert done, "none of A's requests was answered within 120 s"
            refused += [t.result().status_code for t in done]
        other = await b.post(base + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2,
                                                                  "temperature": 0})
        for t in pending:  # A leaves: its requests are cancelled
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.result().status_code == 429:
                assert "over capacity" in t.result().json()["error"]["message"], t.result().text
        return refused, other


def test_one_http_clients_burst_leaves_another_served(node, tmp_path):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "4096", "--max-num-seqs", "2048",
                  "--max-num-batched-tokens", "4096", "--http-port", str(http)) as ln:
        _wait_healthy(http)
        refused, other = asyncio.run(_burst_then_other(f"http://127.0.0.1:{http}"))
        assert refused and set(refused) == {429}, refused
        assert other.status_code == 200, other.text
        assert other.json()["choices"][0]["token_ids"] == oracle().generate_dense([5, 6, 7], 2)
        assert ln.proc.poll() is None
