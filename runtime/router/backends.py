"""The router's backends: their health, their load, and what their caches hold.

Each backend is a kvrt node's HTTP base URL. The router learns from `GET /kvrt/cache` how the
node keys its blocks (block size, key root: runtime/cache/keys.py) and where it publishes its KV
events, and keeps a view of its cache from them (runtime/cache/events.py KVEventView). A node whose
events need the deployment secret (runtime/cache/event_secret.py) is read with the router's
`--events-secret-file`, if it is the same secret; otherwise the node gets no cache affinity. A health
thread asks every backend's `/health` every HEALTH_INTERVAL_S; a backend that fails it (or a
request's connection) is out until it answers again, and then its view starts afresh (a node
that restarted numbers its batches from 1 again). An events thread applies every backend's
batches as they arrive.

Events come after the fact (a node publishes a block once its prefill wrote it), so a backend
also keeps the keys of the requests the router sent it for PENDING_S: a request that shares a
prefix with one still in its prefill counts that prefix as held there (as it will be), instead
of seeing a cold fleet and going elsewhere. What the events say overrides nothing else: a key
the node evicted is held only while it is pending.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx2
import zmq

from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.runtime.cache.events import KVEventView
from kvrt.runtime.cache.keys import KEY_BYTES

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 1.0
EVENTS_POLL_MS = 100  # the events thread's longest sleep: how soon it sees a view to renew, or the stop
PENDING_S = 2.0       # a sent request's keys count as held this long (its prefill is under way)
PENDING_MAX = 1 << 16  # pending keys kept per backend before the stale ones are dropped
SLOW_TIER = 0.5       # a block on host memory or storage only counts for this much of one on the device


def base_url(url: str) -> str:
    """A backend URL as given (`http://h:8000`, `http://h:8000/v1`, with or without a trailing
    slash) as its base URL without /v1. ValueError when it is not an http(s) URL with a host."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"backend {url!r} is not an http(s) URL with a host (e.g. http://127.0.0.1:8000)")
    return u


@dataclass
class Backend:
    """One node: its health, requests the router has in flight there, and its cache view."""

    url: str
    healthy: bool = False
    inflight: int = 0
    block_size: int = 0
    key_root: bytes = b""
    model_dir: str = ""
    max_model_len: int = 0  # 0: not said
    slow_until: float = 0.0  # time.monotonic() until which requests avoid it (it timed out)
    described: bool = False  # /kvrt/cache was asked (a node without it gets no cache affinity)
    view: KVEventView | None = None
    failures: int = 0
    routed: int = 0
    up_count: int = 0  # times it came up; the events thread renews the view when this moves
    view_of: int = 0   # the up_count the view was made for
    pending: dict[bytes, float] = field(default_factory=dict, repr=False)  # key -> when a request with it was sent
    _events_addr: tuple[str, str] | None = field(default=None, repr=False)
    _events_secret: EventSecret | None = field(default=None, repr=False)  # the node's events need it

    def keys_of(self, keys_by_root: dict[tuple[bytes, int], list[bytes]]) -> list[bytes]:
        """A request's block keys as this node chains them ([] when not known)."""
        return keys_by_root.get((self.key_root, self.block_size), []) if self.key_root else []

    def cached_prefix(self, keys: list[bytes], now: float) -> float:
        """Leading blocks of a request this node holds, from its KV events (a block on a slower
        tier counting SLOW_TIER), then those of requests sent to it within PENDING_S (0 without
        events)."""
        view = self.view
        if view is None or not keys:
            return 0
        n, worth = view.weighted_prefix(keys, SLOW_TIER)
        pending, since = self.pending, now - PENDING_S
        while n < len(keys) and pending.get(keys[n], 0.0) >= since:
            n += 1
            worth += 1.0
        return worth

    def sent(self, keys: list[bytes], now: float) -> None:
        """A request with these keys went to this node."""
        pending = self.pending
        if len(pending) + len(keys) > PENDING_MAX:
            since = now - PENDING_S
            self.pending = pending = {k: t for k, t in pending.items() if t >= since}
        for k in keys:
            pending[k] = now


class Backends:
    """Every backend, the health thread and the events thread."""

    def __init__(self, urls: list[str], *, events: bool = True, health_interval: float = HEALTH_INTERVAL_S,
                 ctx: zmq.Context | None = None, secret: EventSecret | None = None):
        if not urls:
            raise ValueError("give at least one backend")
        if not health_interval > 0:
            raise ValueError(f"the health interval must be > 0 s, got {health_interval}")
        self.items = [Backend(base_url(u)) for u in urls]
        self.events = events
        self.secret = secret
        self.health_interval = health_interval
        self._ctx = ctx or zmq.Context()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._health_loop, name="route-health", daemon=True)]
        if events:
            self._threads.append(threading.Thread(target=self._events_loop, name="route-events", daemon=True))
        self._http = httpx2.Client(timeout=HEALTH_TIMEOUT_S)

    def start(self) -> None:
        self.check_all()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.ident is None:
                continue  # never started
            t.join(5.0)
            if t.is_alive():
                log.warning("router thread %s did not stop within 5 s", t.name)
        for b in self.items:
            if b.view is not None:
                b.view.close()
                b.view = None
        self._http.close()
        self._ctx.term()

    def healthy(self) -> list[int]:
        return [i for i, b in enumerate(self.items) if b.healthy]

    def mark_down(self, i: int, why: str) -> None:
        """A request could not reach backend i: out until its next good health check."""
        b = self.items[i]
        if b.healthy:
            log.warning("backend %s is down: %s", b.url, why)
        b.healthy = False

    # ---- health
    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval):
            self.check_all()

    def check_all(self) -> None:
        for b in self.items:
            self._check(b)

    def _check(self, b: Backend) -> None:
        try:
            ok = self._http.get(b.url + "/health").status_code == 200
            if ok and not b.described:
                self._describe(b)
        except (httpx2.HTTPError, ValueError) as e:
            ok = False
            why = str(e) or type(e).__name__
        else:
            why = "/health did not answer 200"
        if ok and not b.healthy:
            log.info("backend %s is up", b.url)
            b.up_count += 1
        elif not ok and b.healthy:
            log.warning("backend %s is down: %s", b.url, why)
        if not ok:
            b.failures += 1
        b.healthy = ok

    def _describe(self, b: Backend) -> None:
        """Learn how the node keys blocks and where its events are (GET /kvrt/cache; checked:
        a node's answer is input)."""
        r = self._http.get(b.url + "/kvrt/cache")
        if r.status_code != 200:
            log.warning("backend %s does not describe its cache (%d): it gets no cache affinity", b.url, r.status_code)
            b.described = True
            return
        try:
            info = r.json()
            root = bytes.fromhex(info["key_root"])
            bs = int(info["block_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"backend {b.url}: /kvrt/cache is not a cache description: {e!r:.200}") from None
        if len(root) != KEY_BYTES or bs <= 0:
            raise ValueError(f"backend {b.url}: bad key root or block size in /kvrt/cache")
        b.block_size, b.key_root, b.described = bs, root, True
        b.model_dir = str(info.get("model_dir") or "")
        mml = info.get("max_model_len")
        b.max_model_len = mml if isinstance(mml, int) and 0 < mml <= 1 << 24 else 0
        ev, rp, curve = info.get("kv_events"), info.get("kv_events_replay"), info.get("kv_events_curve_key")
        if isinstance(ev, str) and isinstance(rp, str) and curve is not None and self.events:
            if self.secret is None:
                log.warning("backend %s publishes its KV events for holders of its --events-secret-file only: "
                            "give kvrt route the same file, or it gets no cache affinity", b.url)
                return
            if curve != self.secret.server_public.decode():
                log.warning("backend %s publishes its KV events under another secret than this router's "
                            "--events-secret-file: it gets no cache affinity", b.url)
                return
        if isinstance(ev, str) and isinstance(rp, str):
            host = urlsplit(b.url).hostname
            b._events_addr = (ev.replace("0.0.0.0", host), rp.replace("0.0.0.0", host))
            b._events_secret = self.secret if curve is not None else None
        elif self.events:
            log.warning("backend %s publishes no KV events (--kv-events-port): it gets no cache affinity", b.url)

    # ---- events (views are made, read from sockets and closed on the events thread only)
    def _events_loop(self) -> None:
        """Applies each backend's batches as they arrive. The poller is made again only when the
        views change: an idle router's thread costs one poll per EVENTS_POLL_MS, which its cost
        per request pays on a quiet fleet."""
        poller, polled = zmq.Poller(), []
        while not self._stop.is_set():
            for b in self.items:
                if b.up_count != b.view_of and b._events_addr is not None:
                    self._renew_view(b)
            views = [b.view for b in self.items if b.view is not None]
            if not views:
                self._stop.wait(EVENTS_POLL_MS / 1000)
                continue
            if views != polled:
                poller, polled = zmq.Poller(), views
                for v in views:
                    poller.register(v.sub, zmq.POLLIN)
            ready = dict(poller.poll(EVENTS_POLL_MS))
            for v in views:
                if v.sub in ready:
                    v.poll(0)

    def _renew_view(self, b: Backend) -> None:
        """A fresh view of a backend that came (back) up (a restarted node numbers its batches
        from 1 again), caught up from its replay socket."""
        old, b.view = b.view, None
        if old is not None:
            old.close()
        view = KVEventView(*b._events_addr, self._ctx, b._events_secret)
        view.sync()
        b.view, b.view_of = view, b.up_count
