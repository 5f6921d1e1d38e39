"""The exceptions every kvrt process may see from ipc/, in one place so callers can catch by kind."""


class IpcError(Exception):
    """Base class of every ipc/ failure."""


class WaitTimeout(IpcError, TimeoutError):
    """A wait ran out of time; the message names what was awaited and from whom."""


class PeerDead(IpcError):
    """The process on the other side of a channel is gone (pid dead or zombie)."""


class ChannelClosed(IpcError):
    """The channel was closed by its owner or peer; no more records will come."""


class RecordTooLarge(IpcError, ValueError):
    """A record exceeds what the ring can ever hold; refused before anything was written."""


class ProtocolError(IpcError, ValueError):
    """A message could not be decoded: malformed bytes, unknown type or unsupported version."""


class NodeLive(IpcError):
    """A node with this name is alive; its objects must not be clobbered or reclaimed."""


class RingCorrupt(ChannelClosed, ProtocolError):
    """A ring's record framing is damaged (a length, wrap marker or position tag that the
    producer cannot have written). The ring is marked broken and no record from it is
    trusted again: its owner must fail, not skip, because the framing is lost."""
