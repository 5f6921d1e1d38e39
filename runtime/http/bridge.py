"""The one thread that owns the HTTP server's ZeroMQ client.

Why a thread and a queue: a `Client` (and its ZeroMQ socket) is not thread-safe, and its waits
block, so it cannot live on the asyncio loop that serves HTTP. This thread alone touches it:
the loop hands it submissions and cancels through a queue, and it hands each request's events
back to that request's asyncio queue with `call_soon_threadsafe`. The engine runs in its own
process, so nothing here can block the engine loop.

Every HTTP request waits on this thread, and this thread never leaves one waiting for ever: a
request ends with the engine's answer; or with an error when the bridge stops or fails; or, when
the engine sends nothing at all (not even the liveness probes it sends every api.PROBE_S to a
client with requests in flight, steps or no steps) for `engine_timeout` s while requests are in
flight, with an error naming the engine that went silent (stopped, hung, or its connection
gone), and the requests are cancelled there. That watch is this thread's own (its client's is
off), so that its error names the flag that sets it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from kvrt.runtime.client.api import LIVENESS_S, ErrorEvent, InfoReply, ResetPrefixCacheReply
from kvrt.runtime.client.client import Client, ClientError, Result, Sampling

log = logging.getLogger(__name__)

POLL_S = 0.005     # how long the thread waits for the engine before it looks at its inbox again
ENGINE_TIMEOUT_S = LIVENESS_S  # the engine's longest silence with requests in flight (it probes every PROBE_S)
UNRESPONSIVE = "engine_unresponsive"
INFO_WAIT_S = 1.0  # one try at the node's info while it starts
RESET_WAIT_S = 10.0  # for the engine's answer to a prefix-cache reset (it answers within a loop turn)


@dataclass
class Submission:
    """A request for the engine, and where its events go."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    eos_token_id: int
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cache_salt: str = ""
    on_behalf_of: str = ""  # the HTTP client's identity: its quota at the engine is its own
    stream: bool = True  # False: the engine sends only the finished answer (nothing reads it before)


class Bridge:
    """Submits requests for the HTTP handlers and routes the engine's answers back to them."""

    def __init__(self, address: str, engine_timeout: float = ENGINE_TIMEOUT_S) -> None:
        if not engine_timeout > 0:
            raise ValueError(f"the engine timeout must be > 0 s, got {engine_timeout}")
        self.address = address
        self.engine_timeout = engine_timeout
        self._busy_since = 0.0  # when requests came in flight after none were
        self.info: InfoReply | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, Submission] = {}
        self._ids = itertools.count(1)
        self._prefix = f"http-{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvrt-http-bridge", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the HTTP bridge thread did not stop within %g s", timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stop.is_set()

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def submit(self, sub: Submission) -> None:
        self._inbox.put(("submit", sub))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    async def reset_prefix_cache(self) -> ResetPrefixCacheReply:
        """Ask the engine to reset its prefix cache; ClientError if it did not answer."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        self._inbox.put(("reset", (loop, answer)))
        try:  # (the thread's own wait is RESET_WAIT_S; this one also covers a thread that stopped)
            return await asyncio.wait_for(answer, RESET_WAIT_S + 1.0)
        except asyncio.TimeoutError:
            raise ClientError(f"no answer to a prefix-cache reset from the HTTP bridge within "
                              f"{RESET_WAIT_S + 1.0:g} s") from None

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with Client(self.address, timeout=30.0, liveness=None) as client:
                while not self._stop.is_set() and self.info is None:
                    try:
                        self.info = client.info(timeout=INFO_WAIT_S)
                    except ClientError:
                        continue  # the node is still starting
                self._ready.set()
                while not self._stop.is_set():
                    self._drain(client)
                    for ev in client.poll(POLL_S):
                        self._route(ev)
                    self._check_engine(client)
        except Exception:  # the thread must not die silently: every waiter gets an answer
            log.exception("the HTTP bridge to %s failed", self.address)
        finally:
            self._stop.set()
            for rid in list(self._routes):
                self._deliver(rid, ErrorEvent(request_id=rid, code="stopping", message="the HTTP server is stopping"),
                              last=True)

    def _check_engine(self, client: Client) -> None:
        """Fail (and cancel) every request in flight when the engine has sent nothing for
        `engine_timeout` s since they came in flight."""
        if not self._routes:
            self._busy_since = 0.0
            return
        now = time.monotonic()
        if not self._busy_since:
            self._busy_since = now
        silent = now - max(client.last_heard, self._busy_since)
        if silent < self.engine_timeout:
            return
        why = (f"the engine at {self.address} sent nothing for {silent:.1f} s (not even its liveness probes) "
               f"while requests were in flight: it is stopped, hung or unreachable (--http-engine-timeout "
               f"{self.engine_timeout:g})")
        log.error("%s: failing its %d requests", why, len(self._routes))
        for rid in list(self._routes):
            try:
                client.cancel(rid)  # (read once it runs again)
            except ClientError:
                pass
            self._deliver(rid, ErrorEvent(request_id=rid, code=UNRESPONSIVE, message=why), last=True)
        self._busy_since = 0.0

    def _drain(self, client: Client) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "cancel":  # its route stays: the engine's last answer (with its usage) still comes
                if item in self._routes:
                    try:
                        client.cancel(item)
                    except ClientError as e:
                        log.warning("cancel of %s not sent: %s", item, e)
                continue
            if kind == "reset":
                self._reset(client, *item)
                continue
            sub: Submission = item
            self._routes[sub.request_id] = sub
            try:
                client.submit(np.asarray(sub.prompt, dtype=np.int64), sub.max_tokens, eos_token_id=sub.eos_token_id,
                              request_id=sub.request_id, stream=sub.stream, sampling=sub.sampling,
                              cache_salt=sub.cache_salt, on_behalf_of=sub.on_behalf_of)
            except Exception as e:  # noqa: BLE001 - one request's failure must not end the thread
                if not isinstance(e, (ValueError, ClientError)):
                    log.exception("request %s could not be sent", sub.request_id)
                code = "stopping" if isinstance(e, ClientError) else "bad_request"
                self._deliver(sub.request_id, ErrorEvent(request_id=sub.request_id, code=code, message=str(e)),
                              last=True)

    @staticmethod
    def _reset(client: Client, loop: asyncio.AbstractEventLoop, answer: asyncio.Future) -> None:
        """Reset the engine's prefix cache for an HTTP handler (the events of requests that
        arrive meanwhile wait in the client for the next poll)."""
        def done(ok: bool, value) -> None:
            if not answer.done():  # (cancelled when its HTTP client went away)
                (answer.set_result if ok else answer.set_exception)(value)

        try:
            args = (True, client.reset_prefix_cache(timeout=RESET_WAIT_S))
        except ClientError as e:
            args = (False, e)
        try:
            loop.call_soon_threadsafe(done, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _route(self, ev) -> None:
        rid = ev.request_id
        self._deliver(rid, ev, last=isinstance(ev, (Result, ErrorEvent)))

    def _deliver(self, rid: str, ev, last: bool) -> None:
        sub = self._routes.pop(rid, None) if last else self._routes.get(rid)
        if sub is None:
            return  # cancelled by its HTTP handler: nobody waits for it
        try:
            sub.loop.call_soon_threadsafe(sub.events.put_nowait, (rid, ev))
        except RuntimeError:  # the loop is closed: the server is gone
            pass


