"""The wire codec: msgpack maps with a type and a version, int32 arrays as raw bytes.

Why not pickle: a record in shared memory or on a socket comes from another process; unpickling
it would run whatever it says. msgpack only ever yields plain data, and a schema check turns
anything unexpected into a ProtocolError that the consumer counts and survives.

A message type is a dataclass decorated with `@message("name", version)`. Fields annotated as
`np.ndarray` travel as little-endian int32 bytes (block-id lists: one memcpy, no per-element
encoding) and come back as read-only int32 arrays. A field with a default may be absent from
a message (an older peer does not know a field added since) and then takes its default.

Bounds on what decoding builds: msgpack refuses a string, binary, array or map that claims more
entries or bytes than the message holds, and nesting past its own stack (1,024 levels); the
message itself is bounded where it is read (a socket's or a ring's record limit). A decoder of
untrusted messages also passes `max_depth`: the maps and arrays of a message then nest no deeper
than that (MAX_DEPTH: our deepest, an answer's alternatives per position, takes four), so no code
that later walks a field recursively can be driven into Python's recursion limit. The check walks
every array once, so the engine's trusted rings and the clients' large answers do without it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

import msgpack
import numpy as np

from kvrt.ipc.errors import ProtocolError

T = TypeVar("T")
_I32 = np.dtype("<i4")
MAX_DEPTH = 16  # nesting of maps and arrays a decoder of untrusted messages accepts (the message's own map is 1)


@dataclasses.dataclass(frozen=True)
class _Schema:
    cls: type
    version: int
    fields: tuple[str, ...]
    arrays: frozenset[str]
    optional: frozenset[str]  # fields with a default: they may be absent


class Codec:
    """A set of message types. Separate instances keep unrelated protocols (and tests) apart."""

    def __init__(self) -> None:
        self._by_name: dict[str, _Schema] = {}
        self._by_cls: dict[type, tuple[str, _Schema]] = {}

    def message(self, name: str, version: int = 1) -> Callable[[type[T]], type[T]]:
        """Class decorator registering a dataclass as message type `name` at `version`."""

        def register(cls: type[T]) -> type[T]:
            if name in self._by_name:
                raise ValueError(f"message type {name!r} registered twice")
            if not dataclasses.is_dataclass(cls):
                cls = dataclasses.dataclass(cls)
            fields = dataclasses.fields(cls)
            arrays = frozenset(f.name for f in fields if "ndarray" in str(f.type))
            optional = frozenset(f.name for f in fields if f.default is not dataclasses.MISSING
                                 or f.default_factory is not dataclasses.MISSING)
            schema = _Schema(cls, version, tuple(f.name for f in fields), arrays, optional)
            self._by_name[name] = schema
            self._by_cls[cls] = (name, schema)
            return cls

        return register

    def encode(self, msg: Any) -> bytes:
        try:
            name, schema = self._by_cls[type(msg)]
        except KeyError:
            raise ProtocolError(f"cannot encode {type(msg).__name__}: not a registered message type") from None
        body: dict[str, Any] = {"t": name, "v": schema.version}
        for f in schema.fields:
            v = getattr(msg, f)
            body[f] = np.ascontiguousarray(v, dtype=_I32).tobytes() if f in schema.arrays else v
        return msgpack.packb(body, use_bin_type=True)

    def decode(self, data: bytes, max_depth: int | None = None) -> Any:
        """Bytes -> message object; anything unexpected raises ProtocolError (never crashes).
        `max_depth`: refuse a message whose maps and arrays nest deeper (module docstring)."""
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise ProtocolError(f"undecodable message ({len(data)} bytes): {type(e).__name__} {e}") from None
        if not isinstance(body, dict) or "t" not in body or "v" not in body:
            raise ProtocolError("message is not a map with a type and a version")
        if max_depth is not None and not nests_within(body, max_depth):
            raise ProtocolError(f"message nests maps and arrays more than {max_depth} levels deep")
        schema = self._by_name.get(body["t"]) if isinstance(body["t"], str) else None
        if schema is None:
            raise ProtocolError(f"unknown message type {body['t']!r}")
        if body["v"] != schema.version:
            raise ProtocolError(f"message {body['t']!r} version {body['v']!r} not supported "
                                f"(this build speaks version {schema.version})")
        kwargs = {}
        for f in schema.fields:
            if f not in body:
                if f in schema.optional:  # a field added later: an older peer does not send it
                    continue
                raise ProtocolError(f"message {body['t']!r} lacks field {f!r}")
            v = body[f]
            if f in schema.arrays:
                if not isinstance(v, bytes) or len(v) % 4:
                    raise ProtocolError(f"message {body['t']!r}: field {f!r} is not an int32 array")
                v = np.frombuffer(v, dtype=_I32)
            kwargs[f] = v
        try:
            return schema.cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"message {body['t']!r}: {e}") from None


def nests_within(value: Any, max_depth: int) -> bool:
    """Whether the maps and lists of `value` (as msgpack decodes them) nest at most `max_depth`
    levels deep (`value` itself is level 1). Iterative: the walk itself cannot recurse too deep."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > max_depth:
            return False
        members = item.values() if type(item) is dict else item
        kinds = set(map(type, members))  # (in C: lists of scalars cost one pass)
        if list in kinds or dict in kinds:
            stack.extend((m, level + 1) for m in members if type(m) is list or type(m) is dict)
    return True
