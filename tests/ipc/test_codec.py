from dataclasses import dataclass

import msgpack
import numpy as np
import pytest

from kvrt.ipc.codec import Codec
from kvrt.ipc.errors import ProtocolError
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Consumer, Producer, Ring

codec = Codec()


@codec.message("swap", version=2)
@dataclass
class Swap:
    task_id: int
    src: np.ndarray
    dst: np.ndarray
    note: str = ""


@codec.message("ping")
@dataclass
class Ping:
    seq: int


def test_round_trip_with_raw_int32_arrays():
    m = Swap(7, np.array([1, 2, 3], dtype=np.int64), np.arange(5, dtype=np.int32), "x")
    data = codec.encode(m)
    body = msgpack.unpackb(data)
    assert body["t"] == "swap" and body["v"] == 2 and body["src"] == np.array([1, 2, 3], "<i4").tobytes()
    back = codec.decode(data)
    assert back.task_id == 7 and back.note == "x"
    assert back.src.dtype == np.int32 and back.src.tolist() == [1, 2, 3]
    assert back.dst.tolist() == list(range(5))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x93\x01\x02",  # empty, reserved byte, an array not a map
    msgpack.packb({"t": "nope", "v": 1}),
    msgpack.packb({"t": "swap", "v": 1, "task_id": 1, "src": b"", "dst": b"", "note": ""}),
    msgpack.packb({"t": "swap", "v": 2, "task_id": 1, "src": b""}),
    msgpack.packb({"t": "swap", "v": 2, "task_id": 1, "src": b"abc", "dst": b"", "note": ""}),
    msgpack.packb({"t": 5, "v": 1}),
    msgpack.packb({"v": 1}),
    msgpack.packb({1: 2}),
    b"\x81\xa1t",  # truncated
])
def test_malformed_messages_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        codec.decode(data)


def test_unregistered_type_cannot_be_encoded():
    with pytest.raises(ProtocolError):
        codec.encode(object())


def test_duplicate_registration_refused():
    with pytest.raises(ValueError):
        codec.message("ping")(type("Other", (), {"__annotations__": {"a": int}}))


def test_consumer_counts_bad_messages_and_goes_on(node):
    with Registry.create(node) as reg:
        Ring.create(reg, "r", capacity=1 << 14)
        p, c = Producer.attach(reg, "r"), Consumer.attach(reg, "r")
        p.put_many([codec.encode(Ping(1)), b"\xc1garbage", codec.encode(Ping(2))], 1)
        got = []
        for rec in iter(c.try_get, None):
            try:
                got.append(codec.decode(rec).seq)
            except ProtocolError:
                c.count_protocol_error()
        assert got == [1, 2] and c.stats()["protocol_errors"] == 1
        p.detach()
        c.detach()
