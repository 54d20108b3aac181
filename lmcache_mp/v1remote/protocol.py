"""The v1 remote protocol's wire format: headers, number tables, key strings, framing helpers.

This is the TCP format of LMCache's standalone remote server (`lmcache_server HOST PORT`); a
peer that follows it interoperates with that server and its clients. In short:

- every request is a 186-byte client header (`ClientMetaMessage`, struct `iiiiiiiii150s`); a PUT's
  header is followed by exactly `length` payload bytes;
- GET, EXIST, HEALTH (and, on our own server only, LIST) are answered with a 36-byte server header
  (`ServerMetaMessage`, struct `iiiiiiiii`, location *last*); a GET hit's and a LIST's header is
  followed by `length` payload bytes. PUT is never answered;
- integers are native C ints (little-endian on x86-64), exactly as Python's `struct` packs them
  without a byte-order prefix;
- every header carries a key string `model@world_size@worker_id@chunk_hash_hex@dtype[@tag%value...]`
  (`format_key`, `parse_key`), padded with spaces to 150 bytes. The reference server parses the key
  of every header, HEALTH included, and drops the connection on one it cannot parse, so this module
  refuses to build or accept a header whose key does not parse.

Anything malformed raises `ProtocolError` (a `ValueError`). Numbers are plain `IntEnum`s: nothing here
imports torch, so the module stays cheap to import (the server does not need torch at all).
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

# Anything with the buffer protocol works (numpy arrays, mmap...); these are the common ones.
Buffer = bytes | bytearray | memoryview


class ProtocolError(ValueError):
    """Bytes or values that do not follow the v1 remote protocol."""


class ClientCommand(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4  # the reference server never answers it: only ask our own server
    HEALTH = 5


class ServerReturnCode(IntEnum):
    SUCCESS = 200
    FAIL = 400


class MemoryFormat(IntEnum):
    """How a payload is laid out (the header's `fmt`)."""

    UNDEFINED = 0
    KV_2LTD = 1  # [2, layers, tokens, hidden]
    KV_T2D = 2
    KV_2TD = 3
    BINARY = 4
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6


class WireDtype(IntEnum):
    """The header's `dtype` number."""

    NONE = 0
    HALF = 1  # the same dtype as FLOAT16; encoders write FLOAT16
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT32 = 4
    FLOAT64 = 5
    UINT8 = 6
    FLOAT8_E4M3FN = 7
    FLOAT8_E5M2 = 8


class Location(IntEnum):
    """The header's `location` number: where the reference server keeps an object."""

    NONE = 0
    LOCAL_CPU = 1
    LOCAL_DISK = 2


# The standalone server's defaults, here so that `lmcache-mp --help` needs no server module.
DEFAULT_PORT = 65432
DEFAULT_MAX_CONNECTIONS = 64

MAX_KEY_LENGTH = 150  # bytes of UTF-8 in the client header's key field
CLIENT_HEADER_FORMAT = "iiiiiiiii150s"
SERVER_HEADER_FORMAT = "iiiiiiiii"
_CLIENT_STRUCT = struct.Struct(CLIENT_HEADER_FORMAT)
_SERVER_STRUCT = struct.Struct(SERVER_HEADER_FORMAT)
CLIENT_HEADER_SIZE = _CLIENT_STRUCT.size  # 186
SERVER_HEADER_SIZE = _SERVER_STRUCT.size  # 36
INT32_MAX = 2**31 - 1  # the largest `length` a header can carry

# The dtype names a key string may end its fixed part with.
KEY_DTYPES = frozenset({"half", "bfloat16", "float", "double", "int8", "uint8", "int16", "int32",
                        "int64", "bool"})

Shape = tuple[int, int, int, int]
ZERO_SHAPE: Shape = (0, 0, 0, 0)


# --- key strings ------------------------------------------------------------------------------

_DECIMAL = re.compile(r"[0-9]+")
_LOWER_HEX = re.compile(r"[0-9a-f]+")
# ASCII control characters: no model name has them, and a "\n" would break LIST's listing.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class ParsedKey:
    """The parts of a key string. `str(key)` gives the key string back."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: str  # lowercase hex, as written in the key
    dtype: str  # one of KEY_DTYPES
    tags: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return format_key(self.model_name, self.world_size, self.worker_id, self.chunk_hash, self.dtype,
                          dict(self.tags))


def format_key(model_name: str, world_size: int, worker_id: int, chunk_hash_hex: str, dtype_name: str,
               tags: Mapping[str, str] | None = None) -> str:
    """`model@world_size@worker_id@chunk_hash_hex@dtype[@tag%value...]`, checked with `parse_key`.

    Long model names do not fit the 150-byte limit: pass a short, stable form (e.g. a digest)."""
    for name, value in (("world_size", world_size), ("worker_id", worker_id)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProtocolError(f"{name} must be a non-negative int, not {value!r}")
    tag_items = tuple((tags or {}).items())
    key = f"{model_name}@{world_size}@{worker_id}@{chunk_hash_hex}@{dtype_name}"
    key += "".join(f"@{tag}%{value}" for tag, value in tag_items)
    parsed = parse_key(key)
    # A part holding a separator would parse into different parts: refuse rather than alias a key.
    expected = ParsedKey(model_name, world_size, worker_id, chunk_hash_hex, dtype_name, tag_items)
    if parsed != expected:
        raise ProtocolError(f"key parts {expected} do not survive formatting (a part holds '@' or '%')")
    return key


# The shape of a well-formed key, for the fast path of `parse_key` (every header carries a key, so
# parsing it is on the path of every request).
_KEY_SHAPE = re.compile(r"([^@]+)@([0-9]+)@([0-9]+)@([0-9a-f]+)@([^@]+)((?:@[^@%]+%[^@%]+)*)")


def parse_key(key: str) -> ParsedKey:
    """Parse and check a key string; ProtocolError on anything the reference server can't parse.

    Two rules beyond the reference's own: no leading/trailing whitespace (the header's space padding
    is stripped, so it would not survive the trip) and no ASCII control characters (they have no place
    in a model name, and LIST separates keys with newlines). The model name must not be empty."""
    match = _KEY_SHAPE.fullmatch(key) if isinstance(key, str) and key.isascii() else None
    if (match and match[5] in KEY_DTYPES and len(key) <= MAX_KEY_LENGTH and not key[0].isspace()
            and not key[-1].isspace() and not _CONTROL.search(key)):
        tags = tuple(tuple(part.split("%")) for part in match[6][1:].split("@")) if match[6] else ()
        return ParsedKey(match[1], int(match[2]), int(match[3]), match[4], match[5], tags)  # type: ignore[arg-type]
    return _parse_key_slowly(key)


def _parse_key_slowly(key: str) -> ParsedKey:
    """`parse_key` for any key the fast path did not accept: each rule in turn, with its message."""
    if not isinstance(key, str):
        raise ProtocolError(f"a key is a str, not {type(key).__name__}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise ProtocolError(f"key {key!r} is not encodable as UTF-8") from err
    if size > MAX_KEY_LENGTH:
        raise ProtocolError(f"key is {size} bytes of UTF-8, more than {MAX_KEY_LENGTH}")
    if key != key.strip() or _CONTROL.search(key):
        raise ProtocolError(f"key {key!r} has surrounding whitespace or control characters")
    parts = key.split("@")
    if len(parts) < 5:
        raise ProtocolError(f"key {key!r} needs model@world_size@worker_id@chunk_hash@dtype")
    model, world_size, worker_id, chunk_hash, dtype, *tag_parts = parts
    if not model:
        raise ProtocolError(f"key {key!r} has an empty model name")
    if not (_DECIMAL.fullmatch(world_size) and _DECIMAL.fullmatch(worker_id)):
        raise ProtocolError(f"key {key!r}: world_size and worker_id must be decimal integers")
    if not _LOWER_HEX.fullmatch(chunk_hash):
        raise ProtocolError(f"key {key!r}: the chunk hash must be lowercase hex")
    if dtype not in KEY_DTYPES:
        raise ProtocolError(f"key {key!r}: dtype {dtype!r} is not one of {sorted(KEY_DTYPES)}")
    return ParsedKey(model, int(world_size), int(worker_id), chunk_hash, dtype,
                     tuple(_parse_tag(key, part) for part in tag_parts))


def _parse_tag(key: str, part: str) -> tuple[str, str]:
    tag, sep, value = part.partition("%")
    if not sep or not tag or not value or "%" in value:
        raise ProtocolError(f"key {key!r}: tag part {part!r} is not tag%value")
    return tag, value


# Any valid key: HEALTH and LIST carry it because the reference parses the key of every header.
HEALTH_KEY = "lmcache_mp_health@1@0@0@half"


# --- headers ----------------------------------------------------------------------------------

def pad_shape(shape: Sequence[int]) -> Shape:
    """A shape of at most 4 non-negative dims, padded with trailing zeros to 4."""
    dims = tuple(shape)
    if len(dims) > 4 or any(not isinstance(d, int) or d < 0 for d in dims):
        raise ProtocolError(f"shape {shape!r} is not at most 4 non-negative ints")
    padded = (*dims, 0, 0, 0, 0)
    return padded[0], padded[1], padded[2], padded[3]


def _enum(kind: type[IntEnum], value: Any, what: str) -> Any:
    member = kind._value2member_map_.get(value)  # what kind(value) looks up first, without its overhead
    if member is None:
        try:
            return kind(value)
        except ValueError:
            raise ProtocolError(f"unknown {what} {value!r}") from None
    return member


def _check_length(length: Any) -> int:
    if not isinstance(length, int) or not 0 <= length <= INT32_MAX:
        raise ProtocolError(f"length {length!r} is not in 0..{INT32_MAX}")
    return length


@dataclass(frozen=True, slots=True)
class ClientMetaMessage:
    """A client header. Fields are checked (and numbers turned into their enums) on construction."""

    command: ClientCommand
    key: str
    length: int = 0  # payload bytes that follow (PUT); 0 otherwise
    fmt: MemoryFormat = MemoryFormat.UNDEFINED
    dtype: WireDtype = WireDtype.NONE
    shape: Shape = ZERO_SHAPE
    location: Location = Location.NONE

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__  # frozen: normalise in place once, here
        setattr_(self, "command", _enum(ClientCommand, self.command, "command"))
        setattr_(self, "length", _check_length(self.length))
        setattr_(self, "fmt", _enum(MemoryFormat, self.fmt, "memory format"))
        setattr_(self, "dtype", _enum(WireDtype, self.dtype, "dtype"))
        setattr_(self, "location", _enum(Location, self.location, "location"))
        setattr_(self, "shape", pad_shape(self.shape))
        parse_key(self.key)

    def serialize(self) -> bytes:
        key = self.key.encode("utf-8").ljust(MAX_KEY_LENGTH, b" ")  # spaces, not struct's NULs
        return _CLIENT_STRUCT.pack(self.command, self.length, self.fmt, self.dtype, self.location,
                                   *self.shape, key)

    @staticmethod
    def deserialize(data: Buffer) -> ClientMetaMessage:
        if len(memoryview(data)) != CLIENT_HEADER_SIZE:
            raise ProtocolError(f"a client header is {CLIENT_HEADER_SIZE} bytes, not {len(memoryview(data))}")
        command, length, fmt, dtype, location, s0, s1, s2, s3, raw_key = _CLIENT_STRUCT.unpack(data)
        command = _enum(ClientCommand, command, "command")  # first: the clearest sign of garbage
        try:
            key = raw_key.rstrip(b" ").decode("utf-8")
        except UnicodeDecodeError as err:
            raise ProtocolError(f"the key field is not UTF-8: {raw_key[:40]!r}...") from err
        return ClientMetaMessage(command, key, length, fmt, dtype, (s0, s1, s2, s3), location)

    @staticmethod
    def packlength() -> int:
        return CLIENT_HEADER_SIZE


@dataclass(frozen=True, slots=True)
class ServerMetaMessage:
    """A server header (location comes last on the wire)."""

    code: ServerReturnCode
    length: int  # payload bytes that follow (GET hit, LIST)
    fmt: MemoryFormat = MemoryFormat.KV_2LTD
    dtype: WireDtype = WireDtype.FLOAT16
    shape: Shape = ZERO_SHAPE
    location: Location = Location.NONE

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "code", _enum(ServerReturnCode, self.code, "return code"))
        setattr_(self, "length", _check_length(self.length))
        setattr_(self, "fmt", _enum(MemoryFormat, self.fmt, "memory format"))
        setattr_(self, "dtype", _enum(WireDtype, self.dtype, "dtype"))
        setattr_(self, "location", _enum(Location, self.location, "location"))
        setattr_(self, "shape", pad_shape(self.shape))

    @staticmethod
    def status(code: ServerReturnCode) -> ServerMetaMessage:
        """The payload-less answer (GET miss, EXIST, HEALTH): length 0, fmt 1, dtype 2 (float16),
        shape zeros, location 0, exactly as the reference sends it."""
        return ServerMetaMessage(code, 0)

    def serialize(self) -> bytes:
        return _SERVER_STRUCT.pack(self.code, self.length, self.fmt, self.dtype, *self.shape, self.location)

    @staticmethod
    def deserialize(data: Buffer) -> ServerMetaMessage:
        if len(memoryview(data)) != SERVER_HEADER_SIZE:
            raise ProtocolError(f"a server header is {SERVER_HEADER_SIZE} bytes, not {len(memoryview(data))}")
        code, length, fmt, dtype, s0, s1, s2, s3, location = _SERVER_STRUCT.unpack(data)
        return ServerMetaMessage(code, length, fmt, dtype, (s0, s1, s2, s3), location)

    @staticmethod
    def packlength() -> int:
        return SERVER_HEADER_SIZE


# --- framing helpers (blocking sockets) -------------------------------------------------------

_IOV_MAX = 1024  # Linux's limit on the buffers of one sendmsg


def byte_view(buffer: Buffer) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (ValueError for one that is not)."""
    view = memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("buffers must be C-contiguous")
    return view.cast("B")


def recv_exact_into(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; returns the bytes received, fewer than len(view) only if the peer
    closed first (0 at a message boundary is a clean close)."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def send_all(sock: socket.socket, buffers: Sequence[Buffer]) -> None:
    """Send every buffer in order with gathered writes (sendmsg): no concatenating copy."""
    views = [v for v in map(byte_view, buffers) if len(v)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + _IOV_MAX])
        while sent:  # skip what went out; a partial send leaves the rest of one view
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
