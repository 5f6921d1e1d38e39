"""The text pool of an HTTP server (runtime/http/text_pool.py): work runs in its threads, off the
event loop, which keeps serving meanwhile; clients are taken in turn, so one client's queue of
slow jobs delays another's job by the jobs running and one turn of its own; a caller that leaves takes its
waiting job out; a job's error reaches its caller; small jobs run at once."""
from __future__ import annotations

import asyncio
import threading

from kvrt.runtime.http.text_pool import TextPool


def test_clients_take_turns_and_the_loop_keeps_serving():
    gate = threading.Event()
    order: list[str] = []

    def job(name: str) -> str:
        gate.wait(10)
        order.append(name)
        return name

    async def go() -> tuple[list, int]:
        pool = TextPool(workers=1, inline=0)
        burst = [asyncio.ensure_future(pool.run("a", 1, job, f"a{i}")) for i in range(5)]
        await asyncio.sleep(0.05)
        other = asyncio.ensure_future(pool.run("b", 1, job, "b0"))
        ticks = 0
        while ticks < 20:  # the loop turns while a job blocks its worker
            await asyncio.sleep(0.001)
            ticks += 1
        gate.set()
        out = await asyncio.gather(*burst, other)
        pool.close()
        return out, ticks

    out, ticks = asyncio.run(go())
    assert out == ["a0", "a1", "a2", "a3", "a4", "b0"] and ticks == 20
    assert order.index("b0") <= 2, order  # in b's turn: after a's running job and the one whose turn came first


def test_a_caller_that_leaves_takes_its_job_out_and_errors_reach_their_callers():
    gate, ran = threading.Event(), []

    def job(name: str) -> str:
        gate.wait(10)
        ran.append(name)
        if name == "bad":
            raise ValueError("bad job")
        return name

    async def go():
        pool = TextPool(workers=1, inline=0)
        first = asyncio.ensure_future(pool.run("a", 1, job, "bad"))
        left = asyncio.ensure_future(pool.run("a", 1, job, "left"))
        await asyncio.sleep(0.05)
        left.cancel()
        gate.set()
        try:
            await first
        except ValueError as e:
            error = str(e)
        assert await pool.run("a", 1, job, "after") == "after"
        pool.close()
        small = TextPool(workers=1, inline=10)
        assert await small.run("a", 9, lambda: threading.current_thread().name) == threading.current_thread().name
        assert await small.run("a", 10, lambda: threading.current_thread().name) != threading.current_thread().name
        small.close()
        return error

    assert asyncio.run(go()) == "bad job"
    assert ran == ["bad", "after"]
