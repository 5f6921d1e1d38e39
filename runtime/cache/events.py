"""KV events: the engine tells the world which block keys it holds on which tier.

Why: a router in front of several nodes can only send a request to the node that already holds
its prefix if it knows which node holds which blocks. The engine publishes every change of its
prefix cache (a block stored on a tier, a block removed from one, everything cleared) on a
ZeroMQ PUB socket, in vLLM's KV events shape so that routers built for vLLM consume kvrt's too:

- a message is three frames: the topic, the batch's sequence number (8 bytes, big-endian) and
  the payload, a msgpack `KVEventBatch` as vLLM's msgspec structs encode it (array-like, tagged):
  `[ts, [event, ...]]` with events `["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
- block hashes are 16 bytes: the prefix cache's own keys (runtime/cache/keys.py), or, with a
  deployment secret, their keyed hash (runtime/cache/event_secret.py), so that only a subscriber
  holding the secret can tie them to prompts (it hashes a prompt as the node does, then maps the
  keys); `token_ids` is empty (the cache keeps keys, not tokens: a subscriber hashes its own
  prompts); `medium` is "GPU", "CPU" or "STORAGE";
- a model of several layer groups (ipc/layout.py LayerGroups: full attention and sliding
  windows) stores a page per group for a block (runtime/cache/groups.py): group 0's pages are
  announced as above, the others' with the fields vLLM's hybrid KV cache manager added after
  `medium`: `[..., medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window]` (kind "sliding_window" with the window in tokens, or
  "full_attention"); their keys are the group's page keys (runtime/cache/keys.py group_key), never
  a block's key, so a subscriber that matches prefixes by block keys (`KVEventView`) leaves them
  aside. `BlockRemoved` says no group: a page key names one page of one group;
- one batch per engine step (nothing is sent for a step that changed nothing), numbered 1, 2, ...
  without gaps, so a subscriber that sees a gap knows it missed something.

The engine never waits for a subscriber: the PUB socket has a high-water mark and a batch that
does not fit is dropped (its number is still used, so the gap shows). A subscriber that saw a gap,
or that starts late, asks the replay socket (ROUTER on `--kv-events-port` + 1, the port vLLM uses
next to its PUB port): it sends the 8-byte number of the first batch it lacks and gets every
batch from there still kept (the last `REPLAY_BATCHES`), one `[seq, payload]` message each,
then `[-1, b""]`. When the batches it asks for are no longer kept it gets a snapshot instead: one
batch numbered as the last one published, `AllBlocksCleared` followed by a `BlockStored` for
every block the cache holds now; applying it replaces the subscriber's view, and later batches
apply on top. The replay socket is served by the engine loop itself (between steps), so a
snapshot reads the cache with nobody changing it. With a deployment secret both sockets are
CURVE servers that admit only subscribers holding it (runtime/cache/event_secret.py).

In a node, the engine binds both sockets in the node's private socket directory (ipc/sockets.py)
and the gateway process owns the public ports, relaying to them (runtime/gateway/events_relay.py):
a hostile subscriber's bytes can make libzmq abort the process that reads them, and that process
must not be the one holding the cache. The gateway guards the ports with the secret; the keys
are still blinded here.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import msgpack
import zmq

from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.runtime.node.limits import ZMQ_HANDSHAKE_MS

log = logging.getLogger(__name__)

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
TOPIC = b"kv-events"
SNDHWM = 10_000          # batches queued per subscriber before new ones are dropped
REPLAY_BATCHES = 1_000   # batches kept for replay
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_MAXMSGSIZE = 64  # replay socket: a request is one 8-byte number
CURVE_MAXMSGSIZE = 1024  # replay socket, with CURVE: its handshake's commands must fit
MAX_REPLAY_REQUESTS = 16  # served per engine turn: a flood of requests cannot stall the loop
# replay answers per second, in bursts of MAX_REPLAY_REQUESTS: a subscriber asks only when it
# missed a batch, so a flood of requests waits in its connections instead of taking engine turns
REPLAY_PER_S = 64.0

Event = list  # one event as it is encoded: [tag, fields...]


class CacheObserver(Protocol):
    """What the prefix cache calls when a node gains or loses a block on a tier. `parent` is
    the key of the block before the first of `keys` (None at the root); `keys` are chained."""

    def stored(self, medium: str, keys: Sequence[bytes], parent: bytes | None, group: int = 0) -> None:
        """`keys` (group `group`'s pages, runtime/cache/groups.py, if not 0) are now readable on `medium`."""

    def removed(self, medium: str, keys: Sequence[bytes]) -> None: ...

    def cleared(self) -> None:
        """Every block is gone (a reset): nothing announced before holds any more."""


@dataclass(frozen=True)
class CachedBlock:
    """One block the cache holds now, for a snapshot (`group`: its layer group, and the
    group's window in tokens, 0 for full attention)."""

    key: bytes
    parent: bytes | None
    medium: str
    group: int = 0
    window: int = 0


def stored_event(keys: Sequence[bytes], parent: bytes | None, block_size: int, medium: str, group: int = 0,
                 window: int = 0) -> Event:
    if not group:
        return ["BlockStored", list(keys), parent, [], block_size, None, medium]
    kind = "sliding_window" if window else "full_attention"
    return ["BlockStored", list(keys), parent, [], block_size, None, medium, None, None, group, kind, window or None]


def removed_event(keys: Sequence[bytes], medium: str) -> Event:
    return ["BlockRemoved", list(keys), medium]


def encode_batch(events: list[Event], ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, events], use_bin_type=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """The engine's end: collects events as the cache changes, publishes them as one batch per
    `flush()`, and answers replay requests in `serve_replay()`. Both are called by the engine
    loop; neither blocks.

    `snapshot()` lists every block the cache holds now (for a subscriber that is too far behind).
    With a `secret`, the sockets admit only its subscribers and the keys are published in their
    keyed-hash form; the ZAP handler that admits them runs on a context of the publisher's own,
    so that no other socket of the process is ever asked for credentials.
    """

    def __init__(self, host: str, port: int, block_size: int, snapshot: Callable[[], Iterable[CachedBlock]],
                 ctx: zmq.Context | None = None, secret: EventSecret | None = None,
                 clock: Callable[[], float] = time.monotonic, private: tuple[str, str] | None = None,
                 windows: Sequence[int] = (), replay_per_s: float = REPLAY_PER_S):
        """`private`: the (events, replay) ipc:// addresses to bind instead of host:port and
        port + 1, where the gateway relays them (module docstring): the gateway guards the public
        ports, so these are not CURVE servers, and a replay request comes with the gateway's
        identity before the subscriber's. `windows`: each layer group's window (ipc/layout.py
        LayerGroups.windows), told with the blocks of a model of several. `replay_per_s`: replay
        answers a second (`kvrt launch --kv-events-replay-rate`)."""
        self.block_size = block_size
        self._windows = list(windows)  # each layer group's window (ipc/layout.py LayerGroups.windows)
        self._snapshot = snapshot
        self._secret = secret
        guard = secret if private is None else None
        self._envelope = 1 if private is None else 2  # identity frames before a request's body
        self._own_ctx = guard is not None
        self._ctx = zmq.Context() if guard is not None else ctx or zmq.Context.instance()
        self._auth = guard.authenticator(self._ctx) if guard is not None else None
        self._pending: list[Event] = []
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self.seq = 0
        self.dropped = 0
        self._snap: tuple[int, bytes] | None = None  # the snapshot at a number: the same until it changes
        self._clock = clock
        self._replay_per_s = replay_per_s
        self._tokens, self._refilled = float(MAX_REPLAY_REQUESTS), clock()
        self.pub = self._ctx.socket(zmq.PUB)
        self.replay = self._ctx.socket(zmq.ROUTER)
        try:
            for s in (self.pub, self.replay):
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.HANDSHAKE_IVL, ZMQ_HANDSHAKE_MS)
            self.pub.setsockopt(zmq.SNDHWM, SNDHWM)
            self.replay.setsockopt(zmq.SNDHWM, SNDHWM)
            # a replay request is one 8-byte number: anything larger is cut off before it is buffered
            # (CURVE's handshake commands count too: its INITIATE is some 300 bytes)
            self.replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAXMSGSIZE if guard is None else CURVE_MAXMSGSIZE)
            if guard is not None:
                guard.serve(self.pub)
                guard.serve(self.replay)
            pub_at, replay_at = private or (f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}")
            self.pub.bind(pub_at)
            self.replay.bind(replay_at)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"--kv-events-port: cannot bind {host}:{port} and {port + 1}: {e}") from None

    def _published(self, keys: Sequence[bytes]) -> Sequence[bytes]:
        return keys if self._secret is None else [self._secret.publish(k) for k in keys]

    # ---- the observer the prefix cache calls
    def stored(self, medium: str, keys: Sequence[bytes], parent: bytes | None, group: int = 0) -> None:
        if keys:
            if self._secret is not None and parent is not None:
                parent = self._secret.publish(parent)
            window = self._windows[group] if group < len(self._windows) else 0
            self._pending.append(stored_event(self._published(keys), parent, self.block_size, medium, group, window))

    def removed(self, medium: str, keys: Sequence[bytes]) -> None:
        if keys:
            self._pending.append(removed_event(self._published(keys), medium))

    def cleared(self) -> None:
        self._pending.append(["AllBlocksCleared"])

    # ---- the engine loop
    def flush(self) -> None:
        """Publish what changed since the last flush as one batch (nothing if nothing did)."""
        if not self._pending:
            return
        self.seq += 1
        payload = encode_batch(self._pending)
        self._pending = []
        self._kept.append((self.seq, payload))
        try:
            self.pub.send_multipart([TOPIC, seq_bytes(self.seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # a slow subscriber: it sees the gap and asks for a replay
            self.dropped += 1
            if self.dropped % 1000 == 1:
                log.warning("kv events: %d batches dropped for subscribers that do not keep up", self.dropped)

    def serve_replay(self) -> None:
        """Answer the replay requests that arrived: at most MAX_REPLAY_REQUESTS per call and
        REPLAY_PER_S (or the node's --kv-events-replay-rate) a second, so that requests sent in a loop (each answer can be a snapshot of
        the whole cache) cost the engine a bounded share of its time; the rest wait unread."""
        now = self._clock()
        self._tokens = min(float(MAX_REPLAY_REQUESTS), self._tokens + (now - self._refilled) * self._replay_per_s)
        self._refilled = now
        while self._tokens >= 1.0:
            try:
                frames = self.replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._tokens -= 1.0
            self._answer(frames)

    def _answer(self, frames: list[bytes]) -> None:
        envelope, body = frames[:self._envelope], frames[self._envelope:]
        if body and body[0] == b"":  # a REQ socket's delimiter: echoed, as REQ expects
            envelope.append(b"")
            body = body[1:]
        if len(body) != 1 or len(body[0]) != 8:
            log.warning("kv events: malformed replay request (%d frames) ignored", len(body))
            return
        start = int.from_bytes(body[0], "big", signed=True)
        self.flush()  # everything changed so far has a number before we answer
        try:
            if self._kept and self._kept[0][0] <= max(start, 1):
                for seq, payload in self._kept:
                    if seq >= start:
                        self.replay.send_multipart(envelope + [seq_bytes(seq), payload], flags=zmq.NOBLOCK)
            elif start <= self.seq:
                self.replay.send_multipart(envelope + [seq_bytes(self.seq), self.snapshot_payload()],
                                           flags=zmq.NOBLOCK)
            self.replay.send_multipart(envelope + [END_OF_REPLAY, b""], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("kv events: a replay subscriber does not read; its answer was cut short")

    def snapshot_payload(self) -> bytes:
        """One batch that replaces a subscriber's view with the cache's blocks now. Built once
        per batch number: every change to the cache is an event that takes a new number at the
        flush before any answer, so the snapshot at a number never changes."""
        if self._snap is None or self._snap[0] != self.seq:
            self._snap = (self.seq, self._build_snapshot())
        return self._snap[1]

    def _build_snapshot(self) -> bytes:
        events: list[Event] = [["AllBlocksCleared"]]
        publish = self._secret.publish if self._secret is not None else None
        for b in self._snapshot():
            key, parent = (b.key, b.parent) if publish is None else (publish(b.key), b.parent and publish(b.parent))
            events.append(stored_event([key], parent, self.block_size, b.medium, b.group, b.window))
        return encode_batch(events)

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()
            self._own_ctx = False


# ---- the subscriber's end -------------------------------------------------------------------------
@dataclass
class Batch:
    """A decoded batch: its number and its events (as encoded: [tag, fields...])."""

    seq: int
    ts: float
    events: list[Event]


def decode_batch(seq: int, payload: bytes) -> Batch:
    """A batch from the wire; ValueError when it is not one (a subscriber counts and skips it)."""
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except (msgpack.UnpackException, ValueError) as e:
        raise ValueError(f"batch {seq}: not msgpack: {e}") from None
    if not (isinstance(obj, list) and len(obj) >= 2 and isinstance(obj[0], (int, float))
            and isinstance(obj[1], list) and all(isinstance(e, list) and e and isinstance(e[0], str) for e in obj[1])):
        raise ValueError(f"batch {seq}: not a KVEventBatch")
    return Batch(seq, float(obj[0]), obj[1])


REPLAY_TIMEOUT_S = 2.0


class KVEventView:
    """One node's cache as its KV events tell it: which keys it holds, on which media.

    `poll()` applies what arrived. A batch whose number skips some asks the replay socket for
    the missing ones (or a snapshot, which replaces the view) before it is applied; a subscriber
    that starts late does the same at once (`sync()`), so its view starts complete. Malformed
    batches are counted and skipped: a node's events are input, never trusted.

    With the node's `secret` the view subscribes as a CURVE client, and `prefix()` takes the
    node's internal keys and maps them to their published form itself."""

    def __init__(self, events: str, replay: str, ctx: zmq.Context | None = None, secret: EventSecret | None = None):
        self._ctx = ctx or zmq.Context.instance()
        self._secret = secret
        self.replay_addr = replay
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            secret.subscribe(self.sub)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(events)
        self.media: dict[bytes, set[str]] = {}
        self.last_seq = 0
        self.gaps = 0
        self.snapshots = 0
        self.malformed = 0
        self.lost = 0  # batches a replay could not bring back (the view may lack their changes)

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` (internal block keys) the node holds (any tier)."""
        n = 0
        media = self.media
        publish = self._secret.publish if self._secret is not None else None
        for k in keys:
            if (k if publish is None else publish(k)) not in media:
                break
            n += 1
        return n

    def weighted_prefix(self, keys: Sequence[bytes], slow: float) -> tuple[int, float]:
        """How many leading `keys` the node holds (as `prefix`), and their worth: a block held
        on no tier but a slower one than the device (host memory, storage) counts `slow`, as it
        must be copied back before it serves."""
        n, worth = 0, 0.0
        media = self.media
        publish = self._secret.publish if self._secret is not None else None
        for k in keys:
            held = media.get(k if publish is None else publish(k))
            if held is None:
                break
            n += 1
            worth += 1.0 if GPU in held else slow
        return n, worth

    def sync(self) -> None:
        """Catch up from the replay socket (everything after the last batch applied)."""
        self._replay(self.last_seq + 1, None)

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that has arrived, waiting at most `timeout_ms` for the first one.
        Returns how many were applied."""
        applied = 0
        while self.sub.poll(timeout_ms if not applied else 0):
            frames = self.sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq <= self.last_seq:
                continue  # already applied (from a replay)
            if seq > self.last_seq + 1:
                self.gaps += 1
                self._replay(self.last_seq + 1, seq)
                if seq <= self.last_seq:
                    continue
            self._apply(seq, frames[2])
            applied += 1
        return applied

    def _replay(self, start: int, upto: int | None) -> None:
        """Ask for the batches from `start` on (a fresh socket per request: a late answer to an
        earlier request can never be mistaken for this one's)."""
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if self._secret is not None:
            self._secret.subscribe(s)
        try:
            s.connect(self.replay_addr)
            s.send_multipart([b"", seq_bytes(start)])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not s.poll(int(left * 1000) + 1):
                    log.warning("kv events: no end of replay from %s within %g s", self.replay_addr,
                                REPLAY_TIMEOUT_S)
                    break
                frames = s.recv_multipart()
                if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                    self.malformed += 1
                    continue
                if frames[1] == END_OF_REPLAY:
                    break
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq > self.last_seq:
                    self.snapshots += seq != self.last_seq + 1  # numbered as the last batch: a snapshot
                    self._apply(seq, frames[2])
        finally:
            s.close(0)
        if upto is not None and self.last_seq < upto - 1:
            self.lost += upto - 1 - self.last_seq
            log.warning("kv events: batches %d..%d from %s are lost", self.last_seq + 1, upto - 1, self.replay_addr)
            self.last_seq = upto - 1

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(seq, payload)
        except ValueError as e:
            self.malformed += 1
            log.warning("kv events: %s", e)
            self.last_seq = seq
            return
        media = self.media
        for ev in batch.events:
            tag = ev[0]
            if tag == "BlockStored" and len(ev) >= 7 and isinstance(ev[1], list) and isinstance(ev[6], str):
                if len(ev) >= 10 and ev[9]:
                    continue  # another layer group's pages: not blocks a prefix is matched by
                for k in ev[1]:
                    if isinstance(k, bytes):
                        media.setdefault(k, set()).add(ev[6])
            elif tag == "BlockRemoved" and len(ev) >= 3 and isinstance(ev[1], list) and isinstance(ev[2], str):
                for k in ev[1]:
                    held = media.get(k) if isinstance(k, bytes) else None
                    if held is not None:
                        held.discard(ev[2])
                        if not held:
                            del media[k]
            elif tag == "AllBlocksCleared":
                media = self.media = {}
            else:
                self.malformed += 1
        self.last_seq = seq

    def close(self) -> None:
        self.sub.close(0)
