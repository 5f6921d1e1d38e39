"""Typed channels: a ring bound to the message types it may carry and to the protocol version
of the build that created it.

A ring carries bytes; what those bytes may be is the contract between two processes that
import nothing of each other. A channel states it once: the creator stamps the ring with its
protocol version, an end that attaches refuses a ring stamped with another version (a process
of an older or newer build would misread every message, or worse, read most of them right),
the sending end refuses a message of a type the channel does not carry before anything is
written, and the receiving end turns a decodable message of the wrong type into the same
ProtocolError as an undecodable one, which the consumer counts and survives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Sequence, TypeVar

from kvrt.ipc.codec import Codec
from kvrt.ipc.errors import IpcError, ProtocolError
from kvrt.ipc.registry import ObjectInfo, Registry
from kvrt.ipc.ring import Consumer, Producer, Ring

E = TypeVar("E", Producer, Consumer)


class VersionMismatch(IpcError):
    """A channel was created by a build that speaks another protocol version; names both."""


@dataclass(frozen=True)
class Channel:
    """One ring's contract: its short name, the message types it carries, their codec, and
    the protocol version both ends must speak."""

    obj: str
    carries: tuple[type, ...]
    codec: Codec
    version: int

    def create(self, reg: Registry, capacity: int, bell: str | None = None) -> ObjectInfo:
        """Create the ring, stamped with this build's protocol version."""
        return Ring.create(reg, self.obj, capacity, bell=bell, meta={"protocol": self.version})

    def check_version(self, info: ObjectInfo) -> None:
        """VersionMismatch unless the ring was created by a build speaking this version."""
        theirs = info.meta.get("protocol")
        if theirs != self.version:
            raise VersionMismatch(f"channel {info.name} was created with protocol version {theirs!r} but this "
                                  f"process speaks version {self.version}: every process of a node must come "
                                  f"from the same kvrt build; refusing to attach")

    def carried(self) -> str:
        """The names of the types this channel carries, for messages."""
        return ", ".join(t.__name__ for t in self.carries)


class _ChannelEnd(Generic[E]):
    def __init__(self, channel: Channel, ring: E):
        self.channel = channel
        self.ring = ring

    @property
    def name(self) -> str:
        return self.ring.name


class Sender(_ChannelEnd[Producer]):
    """The producing end: only messages of the channel's types go in."""

    @classmethod
    def attach(cls, reg: Registry, channel: Channel) -> "Sender":
        channel.check_version(reg.find(channel.obj))
        return cls(channel, Producer.attach(reg, channel.obj))

    def check(self, msg: Any) -> None:
        """TypeError unless this channel carries messages of `msg`'s type."""
        if not isinstance(msg, self.channel.carries):
            raise TypeError(f"channel {self.name} carries {self.channel.carried()}, not {type(msg).__name__}")

    def put(self, msg: Any, timeout: float) -> None:
        """Encode and publish `msg` (a full ring waits up to `timeout` s, never drops); a message
        of a type this channel does not carry is a TypeError, and nothing is written."""
        self.check(msg)
        self.ring.put(self.channel.codec.encode(msg), timeout)

    def close(self) -> None:
        self.ring.close()

    def detach(self) -> None:
        self.ring.detach()


def broadcast(senders: Sequence[Sender], msg: Any, timeout: float) -> None:
    """Publish `msg` on every sender, in order (an order to each rank of a group). Every
    channel is checked before anything is written, so a refused message reaches no rank; the
    message is encoded once per codec, since tp ranks get the same bytes."""
    for s in senders:
        s.check(msg)
    encoded: dict[int, bytes] = {}
    for s in senders:
        codec = s.channel.codec
        if id(codec) not in encoded:
            encoded[id(codec)] = codec.encode(msg)
        s.ring.put(encoded[id(codec)], timeout)


class Receiver(_ChannelEnd[Consumer]):
    """The consuming end: every message it returns is of one of the channel's types."""

    @classmethod
    def attach(cls, reg: Registry, channel: Channel) -> "Receiver":
        channel.check_version(reg.find(channel.obj))
        return cls(channel, Consumer.attach(reg, channel.obj))

    def get(self, timeout: float) -> Any:
        """The next message; waits up to `timeout` s (WaitTimeout, PeerDead, ChannelClosed as the
        ring raises them). ProtocolError for a record that does not decode or is of a type this
        channel does not carry: the record is consumed, the caller counts it and goes on."""
        return self.decode(self.ring.get(timeout))

    def decode(self, data: bytes) -> Any:
        msg = self.channel.codec.decode(data)
        if not isinstance(msg, self.channel.carries):
            raise ProtocolError(f"unexpected {type(msg).__name__} on {self.name} "
                                f"(it carries {self.channel.carried()})")
        return msg

    def close(self) -> None:
        self.ring.close()

    def detach(self) -> None:
        self.ring.detach()
