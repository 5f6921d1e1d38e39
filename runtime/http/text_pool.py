"""Slow text work of an HTTP server (parsing a large body, tokenizing, detokenizing, rendering a
chat template) in a few worker threads, shared fairly between clients, off the event loop.

Why threads: the event loop serves every client, so a job of seconds on it (a long text to
tokenize, a template with nested loops) stalled every other client for as long. In a worker
thread the loop keeps answering: `tokenizers` releases the GIL in the calls kvrt makes
(runtime/client/tokenizer.py), and Python code (templates, validation) is switched away from
every few milliseconds. Each job is bounded by its input, which the server bounds first
(runtime/http/text_limits.py), or by its own limit (a chat template's render time).

Why fair: WORKERS threads, and each client (its address) has its own queue; a free worker takes
the clients in turn, so a client sending many slow jobs delays another's by at most the jobs
already running and one more of each client whose turn comes first. Small jobs (`cost` under INLINE) run on the loop at once: a thread's hand-over
costs more than they do.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

WORKERS = 2      # threads for text work (one per core of a small machine; the loop keeps its own)
INLINE = 4096    # a job's cost (characters, bytes or ids) under which it runs on the loop itself


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple
    done: asyncio.Future


class TextPool:
    """Worker threads for text work, taken by clients in turn (see the module docstring)."""

    def __init__(self, workers: int = WORKERS, inline: int = INLINE) -> None:
        self.workers = workers
        self.inline = inline
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvrt-text")
        self._queues: dict[str, deque[_Job]] = {}
        self._turns: deque[str] = deque()
        self._busy = 0

    async def run(self, who: str, cost: int, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`: at once when `cost` is small, else in a worker thread in `who`'s turn. A
        caller cancelled while its job waits takes it out of the queue (a running job finishes)."""
        if cost < self.inline:
            return fn(*args)
        job = _Job(fn, args, asyncio.get_running_loop().create_future())
        if who not in self._queues:
            self._queues[who] = deque()
            self._turns.append(who)
        self._queues[who].append(job)
        self._dispatch()
        try:
            return await job.done
        finally:  # a raised error's traceback holds this frame: it must not keep the job or its input
            job.args, job, args = (), None, ()

    def _dispatch(self) -> None:
        while self._busy < self.workers and self._turns:
            who = self._turns.popleft()
            queue = self._queues[who]
            job = queue.popleft()
            if queue:
                self._turns.append(who)
            else:
                del self._queues[who]
            if job.done.done():  # its caller left
                continue
            self._busy += 1
            loop = job.done.get_loop()
            future = self._executor.submit(job.fn, *job.args)
            future.add_done_callback(lambda f, job=job, loop=loop: _call_soon(loop, self._finished, f, job))

    def _finished(self, future: concurrent.futures.Future, job: _Job) -> None:
        self._busy -= 1
        if not job.done.done():
            e = future.exception()
            if e is None:
                job.done.set_result(future.result())
            else:
                job.done.set_exception(e)
        self._dispatch()

    def close(self) -> None:
        """Stop taking jobs; a job still running finishes in its thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: the server is gone
        log.debug("a text job finished after its server's loop closed")
