"""Typed channels: a ring carries only its message types, and only between processes that
speak the same protocol version."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from kvrt.ipc import protocol as P
from kvrt.ipc.channel import Channel, Receiver, Sender, VersionMismatch, broadcast
from kvrt.ipc.codec import Codec
from kvrt.ipc.errors import ProtocolError
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Producer, Ring
from tests.conftest import run_py


def test_a_message_of_another_type_is_refused_on_put_before_anything_is_written(node):
    with Registry.create(node) as reg:
        P.worker_orders(0).create(reg, 4096)
        out = Sender.attach(reg, P.worker_orders(0))
        inbox = Receiver.attach(reg, P.worker_orders(0))
        with pytest.raises(TypeError, match="carries StepBatch, Shutdown, not SendDone"):
            out.put(P.SendDone(1, 0, True), 1.0)
        assert inbox.ring.try_get() is None
        out.put(P.Shutdown("done"), 1.0)
        assert inbox.get(1.0) == P.Shutdown("done")
        out.detach()
        inbox.detach()


def test_a_broadcast_reaches_every_rank_or_none(node):
    """An order to a rank group: a type one channel does not carry is refused before any rank
    gets it; otherwise every rank gets the same message."""
    with Registry.create(node) as reg:
        for r in range(2):
            P.worker_orders(r).create(reg, 4096)
        P.transfer_orders(0).create(reg, 4096)
        outs = [Sender.attach(reg, P.worker_orders(r)) for r in range(2)] + [Sender.attach(reg, P.transfer_orders(0))]
        inboxes = [Receiver.attach(reg, ch) for ch in (P.worker_orders(0), P.worker_orders(1), P.transfer_orders(0))]
        outs.reverse()  # the channel that carries it comes first: still nothing is written
        with pytest.raises(TypeError, match="carries StepBatch, Shutdown, not TransferTask"):
            broadcast(outs, P.TransferTask(1, P.SWAP2CPU, [1], [2], []), 1.0)
        assert all(i.ring.try_get() is None for i in inboxes)
        broadcast(outs, P.Shutdown("done"), 1.0)
        assert [i.get(1.0) for i in inboxes] == [P.Shutdown("done")] * 3
        for end in outs + inboxes:
            end.detach()


def test_a_decodable_message_of_another_type_is_a_protocol_error_on_get(node):
    with Registry.create(node) as reg:
        P.worker_answers(0).create(reg, 4096)
        raw = Producer.attach(reg, P.from_worker(0))  # a peer that bypasses the channel
        inbox = Receiver.attach(reg, P.worker_answers(0))
        raw.put(P.PROTOCOL.encode(P.Shutdown("not an answer")), 1.0)
        raw.put(P.PROTOCOL.encode(P.StepResult(7, 0, np.array([3], np.int32))), 1.0)
        with pytest.raises(ProtocolError, match="unexpected Shutdown on .*carries StepResult"):
            inbox.get(1.0)
        assert inbox.get(1.0).step_id == 7  # the bad one was consumed, the channel goes on
        raw.detach()
        inbox.detach()


def test_an_end_of_another_protocol_version_is_refused_on_attach(node):
    with Registry.create(node) as reg:
        P.transfer_orders(0).create(reg, 4096)
        newer = Channel(P.to_transfer(0), (P.TransferTask,), P.PROTOCOL, P.PROTOCOL_VERSION + 1)
        for end in (Sender, Receiver):
            with pytest.raises(VersionMismatch) as e:
                end.attach(reg, newer)
            assert (f"created with protocol version {P.PROTOCOL_VERSION} but this process speaks version "
                    f"{P.PROTOCOL_VERSION + 1}") in str(e.value)
        Ring.create(reg, "unstamped", 4096)  # a ring made without a channel has no version
        with pytest.raises(VersionMismatch, match="protocol version None"):
            Receiver.attach(reg, Channel("unstamped", (P.Shutdown,), P.PROTOCOL, P.PROTOCOL_VERSION))


ATTACH_NEWER = """
import sys
from kvrt.ipc import protocol as P
from kvrt.ipc.channel import Channel, Receiver, VersionMismatch
from kvrt.ipc.registry import Registry
reg = Registry.attach(sys.argv[1])
try:
    Receiver.attach(reg, Channel(P.to_worker(0), (P.StepBatch,), P.PROTOCOL, P.PROTOCOL_VERSION + 1))
except VersionMismatch as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.e2e
def test_a_process_of_another_build_is_refused_on_attach(node):
    """Across processes, through the registry entry the creator wrote."""
    with Registry.create(node) as reg:
        P.worker_orders(0).create(reg, 4096)
        r = run_py(ATTACH_NEWER, node)
        assert r.returncode == 3, r.stderr
        assert f"kvrt.{node}.{P.to_worker(0)}" in r.stdout and "refusing to attach" in r.stdout


def test_channels_of_a_private_codec_keep_their_own_types(node):
    codec = Codec()

    @codec.message("ping")
    @dataclass
    class Ping:
        n: int

    with Registry.create(node) as reg:
        ch = Channel("pings", (Ping,), codec, 1)
        ch.create(reg, 4096)
        out, inbox = Sender.attach(reg, ch), Receiver.attach(reg, ch)
        out.put(Ping(5), 1.0)
        assert inbox.get(1.0) == Ping(5)
        out.detach()
        inbox.detach()
