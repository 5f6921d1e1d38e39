"""KV events: the prefix cache's observer hook tells exactly what the cache holds, and the
publisher's wire format, sequence numbers, replay and snapshot work over real ZeroMQ sockets.

The node-level tests (a real `kvrt launch --kv-events-port`) are in tests/runtime/cache/test_kv_events_node.py.
"""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from kvrt.ipc.ports import free_port_pair
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.cache.events import (CPU, END_OF_REPLAY, GPU, MAX_REPLAY_REQUESTS, REPLAY_BATCHES, REPLAY_PER_S, TOPIC,
                                       CachedBlock, KVEventPublisher,
                               decode_batch, encode_batch, removed_event, seq_bytes, stored_event)
from kvrt.runtime.cache.prefix_cache import PrefixCache, TaskKind
from tests.runtime.cache.test_prefix_cache_props import CacheMachine

WAIT_S = 30.0  # for a socket of this process to connect or answer, however loaded the machine


class Mirror:
    """A subscriber's view, built from the observer calls alone."""

    def __init__(self) -> None:
        self.held: set[tuple[str, bytes]] = set()
        self.groups: dict[bytes, int] = {}  # key -> the layer group it was stored for

    def stored(self, medium, keys, parent, group=0) -> None:
        assert keys and all(len(k) == 16 for k in keys)
        self.held.update((medium, k) for k in keys)
        self.groups.update((k, group) for k in keys)

    def removed(self, medium, keys) -> None:
        self.held.difference_update((medium, k) for k in keys)

    def cleared(self) -> None:
        self.held.clear()


class ObservedCacheMachine(CacheMachine):
    """The prefix cache property machine (random requests, evictions, swaps, storage reads, failed
    tasks, resets), with an observer: after every step its view equals the blocks the cache holds."""

    @initialize(device=st.integers(4, 24), host=st.sampled_from([0, 3, 8, 16]),
                storage=st.booleans(), write_through=st.booleans(), data=st.data())
    def setup(self, device, host, storage, write_through, data):
        super().setup(device, host, storage, write_through, data)
        self.mirror = Mirror()
        self.cache._obs = self.mirror

    @invariant()
    def observer_sees_the_cache(self):
        blocks = self.cache.cached_blocks()
        now = {(b.medium, b.key) for b in blocks}
        assert self.mirror.held == now
        assert all(self.mirror.groups[b.key] == b.group for b in blocks), "a page was told in another group"


ObservedCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                                  suppress_health_check=[HealthCheck.too_slow])
TestObserverMatchesCache = ObservedCacheMachine.TestCase


class ObservedGroupsCacheMachine(ObservedCacheMachine):
    """The same over a model of several layer groups: every group's pages are told, with their group."""

    GROUPS = [(3,), (0, 5), (4, 4)]


ObservedGroupsCacheMachine.TestCase.settings = ObservedCacheMachine.TestCase.settings
TestObserverMatchesGroupedCache = ObservedGroupsCacheMachine.TestCase


def test_recorded_evicted_and_swapped_blocks_are_told_per_tier():
    mirror = Mirror()
    cache = PrefixCache(4, 4, 4, observer=mirror)
    keys = BlockHasher(4).update(list(range(13)))  # 3 full blocks and a partial one
    cache.match("a", keys, 13)
    cache.allocate("a", 13)
    cache.update("a", 13)
    assert mirror.held == {(GPU, k) for k in keys}
    cache.release("a")
    other = BlockHasher(4).update(list(range(100, 113)))
    cache.match("b", other, 13)
    assert cache.allocate("b", 13) is None  # the device is full of cached blocks: they swap out
    [task] = cache.take_tasks()
    assert task.kind == TaskKind.SWAP2CPU
    assert mirror.held == {(GPU, k) for k in keys}  # still readable on the device until done
    cache.apply_task_result(task.task_id, True)
    assert mirror.held == {(CPU, k) for k in task.keys} | {(GPU, k) for k in keys if k not in task.keys}
    assert mirror.held == {(b.medium, b.key) for b in cache.cached_blocks()}


def _sub(ctx: zmq.Context, port: int) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, TOPIC)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _replay(ctx: zmq.Context, port: int, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket the way vLLM's subscriber does (a REQ socket, 8-byte start)."""
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{port + 1}")
    req.send_multipart([b"", seq_bytes(start)])
    return req


def _next_after(sub: zmq.Socket, seq: int) -> list[bytes]:
    """The first batch the subscriber reads numbered above `seq` (earlier ones skipped)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if sub.poll(100):
            frames = sub.recv_multipart()
            if int.from_bytes(frames[1], "big") > seq:
                return frames
    raise AssertionError(f"no batch numbered above {seq} within {WAIT_S:g} s")


def _read_replay(pub: KVEventPublisher, req: zmq.Socket) -> list[tuple[int, bytes]]:
    out = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        pub.serve_replay()
        if req.poll(10):
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                req.close(0)
                return out
            out.append((int.from_bytes(seq, "big", signed=True), payload))
    raise AssertionError(f"no end of replay within {WAIT_S:g} s")


def test_batches_are_numbered_vllm_shaped_and_replayed_or_snapshotted():
    ctx = zmq.Context()
    port = free_port_pair()
    snapshot = [CachedBlock(b"k" * 16, None, GPU), CachedBlock(b"c" * 16, b"k" * 16, CPU)]
    pub = KVEventPublisher("127.0.0.1", port, 16, lambda: snapshot, ctx)
    sub = _sub(ctx, port)
    try:
        # a PUB drops what it sends before the SUB's connection is up: send until one arrives,
        # for as long as a loaded machine takes to connect (those sent meanwhile may still be on
        # their way: they are skipped below by their numbers)
        deadline = time.monotonic() + WAIT_S
        while not sub.poll(20):
            assert time.monotonic() < deadline, f"the subscriber did not connect within {WAIT_S:g} s"
            pub.stored(GPU, [b"x" * 16], None)
            pub.flush()
        sent = pub.seq
        pub.flush()  # nothing pending: no batch, no number used
        pub.stored(GPU, [b"a" * 16, b"b" * 16], b"x" * 16)
        pub.removed(CPU, [b"z" * 16])
        pub.cleared()
        pub.flush()
        topic, seq, payload = _next_after(sub, sent)
        assert topic == TOPIC and int.from_bytes(seq, "big") == pub.seq == sent + 1
        ts, events = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        assert events == [["BlockStored", [b"a" * 16, b"b" * 16], b"x" * 16, [], 16, None, "GPU"],
                          ["BlockRemoved", [b"z" * 16], "CPU"], ["AllBlocksCleared"]]
        assert decode_batch(pub.seq, payload).events == events
        # replay from a kept batch: every batch from there on, in order
        replayed = _read_replay(pub, _replay(ctx, port, pub.seq - 1))
        assert [s for s, _ in replayed] == [pub.seq - 1, pub.seq]
        assert replayed[1][1] == payload
        # more batches than are kept: asking for the first one gets a snapshot at the last number
        for i in range(REPLAY_BATCHES):
            pub.removed(GPU, [i.to_bytes(16, "big")])
            pub.flush()
        [(seq, snap)] = _read_replay(pub, _replay(ctx, port, 1))
        assert seq == pub.seq
        assert decode_batch(seq, snap).events == [
            ["AllBlocksCleared"], ["BlockStored", [b"k" * 16], None, [], 16, None, "GPU"],
            ["BlockStored", [b"c" * 16], b"k" * 16, [], 16, None, "CPU"]]
        assert _read_replay(pub, _replay(ctx, port, pub.seq + 1)) == []  # up to date: nothing
    finally:
        sub.close(0)
        pub.close()
        ctx.term()


def vllm_structs():
    """vLLM's KV event structs, declared here in its shapes: (decode, BlockStored, BlockRemoved,
    AllBlocksCleared), decode taking a payload to a KVEventBatch."""
    msgspec = pytest.importorskip("msgspec")

    opts = dict(array_like=True, omit_defaults=True, gc=False)  # (annotations here are strings: defstruct)
    base = msgspec.defstruct("KVCacheEvent", [], tag=True, **opts)
    BlockStored = msgspec.defstruct("BlockStored", [("block_hashes", list[bytes]), ("parent_block_hash", bytes | None),
                                                    ("token_ids", list[int]), ("block_size", int),
                                                    ("lora_id", int | None), ("medium", str | None)], bases=(base,))
    BlockRemoved = msgspec.defstruct("BlockRemoved", [("block_hashes", list[bytes]), ("medium", str | None)],
                                     bases=(base,))
    AllBlocksCleared = msgspec.defstruct("AllBlocksCleared", [], bases=(base,))
    KVEventBatch = msgspec.defstruct("KVEventBatch", [("ts", float),
                                                      ("events", list[BlockStored | BlockRemoved | AllBlocksCleared])],
                                     **opts)
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode, BlockStored, BlockRemoved, AllBlocksCleared


def test_a_vllm_shaped_decoder_reads_kvrt_batches():
    """vLLM's subscriber decodes batches with msgspec structs (array-like, tagged); the same
    struct shapes, declared here, decode kvrt's payloads, snapshots included."""
    decode, BlockStored, BlockRemoved, AllBlocksCleared = vllm_structs()
    batch = decode(encode_batch([stored_event([b"a" * 16, b"b" * 16], None, 16, GPU),
                                 removed_event([b"a" * 16], CPU), ["AllBlocksCleared"]]))
    assert batch.events == [BlockStored([b"a" * 16, b"b" * 16], None, [], 16, None, "GPU"),
                            BlockRemoved([b"a" * 16], "CPU"), AllBlocksCleared()]


def test_a_flood_of_replay_requests_is_answered_at_a_bounded_rate_from_one_snapshot():
    """Replay requests sent in a loop (each answer a snapshot of the whole cache) take a bounded
    share of the engine's turns: at most MAX_REPLAY_REQUESTS per turn and REPLAY_PER_S a second,
    the snapshot built once per batch number; every request is still answered in the end."""
    ctx = zmq.Context()
    port = free_port_pair()
    builds, now = [], [0.0]

    def snapshot():
        builds.append(1)
        return [CachedBlock(i.to_bytes(16, "big"), None, GPU) for i in range(100)]

    pub = KVEventPublisher("127.0.0.1", port, 16, snapshot, ctx, clock=lambda: now[0])
    flooder = ctx.socket(zmq.DEALER)
    flooder.setsockopt(zmq.LINGER, 0)
    flooder.connect(f"tcp://127.0.0.1:{port + 1}")
    try:
        pub.removed(GPU, [b"x" * 16])
        pub.flush()
        for _ in range(REPLAY_BATCHES + 1):  # more batches than are kept: each answer is a snapshot
            pub.removed(GPU, [b"y" * 16])
            pub.flush()
        n = 3 * MAX_REPLAY_REQUESTS
        for _ in range(n):
            flooder.send_multipart([b"", seq_bytes(1)])

        def answered() -> int:
            ends = 0
            while flooder.poll(50):
                ends += flooder.recv_multipart()[1] == END_OF_REPLAY
            return ends

        got = 0
        for _ in range(50):  # one turn's burst, however often the loop turns at one instant
            pub.serve_replay()
            got += answered()
        assert got == MAX_REPLAY_REQUESTS
        now[0] = 0.5 * MAX_REPLAY_REQUESTS / REPLAY_PER_S  # half a burst's worth of time
        pub.serve_replay()
        assert answered() == MAX_REPLAY_REQUESTS // 2
        got += MAX_REPLAY_REQUESTS // 2
        for k in range(1, 100):  # and every request is answered in the end
            now[0] += 1.0
            pub.serve_replay()
            got += answered()
            if got == n:
                break
        assert got == n
        assert len(builds) == 1, "one snapshot per batch number"
    finally:
        flooder.close(0)
        pub.close()
        ctx.term()
