"""The self-describing object every lower tier stores: a checksummed header, then the chunk's bytes.

One object is one chunk of one rank's KV. Its header names the key and the full `ChunkFormat`, so
a reader can check that the object it got is the one it asked for, in the layout it expects,
whatever the medium did to it (a torn write after a power loss, a flipped bit, a file renamed or
copied by hand, a key-value store shared with another deployment).

Layout (all integers little-endian):

    prefix  (PREFIX_SIZE = 20 bytes, struct "<4sHHHHQ")
        magic            4s   b"LMKV"
        version          u16  VERSION
        hash_len         u16  length of the chunk hash
        fingerprint_len  u16  length of the fingerprint digest (16 today)
        fields_len       u16  length of the encoded ChunkFormat fields
        payload_len      u64  length of the payload
    chunk_hash       hash_len bytes         ChunkKey.chunk_hash
    fingerprint      fingerprint_len bytes  ChunkFormat.fingerprint
    fields           fields_len bytes       ChunkFormat.encode()
    checksum         u64                    xxh3_64 of every header byte before it, then the payload
    payload          payload_len bytes

The prefix alone gives the header's size (`header_size`), so a reader reads the prefix (or a
generous first block), then the rest of the header, checks it against the key (`check_header`)
before touching the payload, reads the payload straight into its destination buffer, and checks
the checksum last (`check_payload`). The checksum is computed in a stream over the header and the
payload, so neither is ever copied to be hashed.

Invariants: a header that passes `check_header(key, ...)` names exactly `key` (chunk hash and
fingerprint) and carries format fields that hash to that fingerprint; an object that also passes
`check_payload` has exactly the bytes that were written under that key. Anything else raises
`CorruptChunk`.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable

import msgspec
import numpy as np
import torch
import xxhash

from lmcache_mp.chunks import ChunkFormat, ChunkKey

MAGIC = b"LMKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHHHHQ")
_CHECKSUM = struct.Struct("<Q")
PREFIX_SIZE = _PREFIX.size
CHECKSUM_SIZE = _CHECKSUM.size  # the last field of a header
_MAX_FIELD = 0xFFFF  # the u16 length fields

Payload = torch.Tensor | memoryview | bytes | bytearray | np.ndarray


class CorruptChunk(Exception):
    """An object that is damaged, truncated, or not the one asked for."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def as_buffer(payload: Payload) -> memoryview:
    """A flat byte view of `payload` without copying (a tensor must be a contiguous CPU tensor)."""
    if isinstance(payload, torch.Tensor):
        payload = payload.numpy()
    return memoryview(payload).cast("B")


def encode_head(key: ChunkKey, payload_len: int) -> bytes:
    """The header of the object that stores `payload_len` bytes under `key`, but its checksum:
    `encode_header` appends it; the pool writes its records in two steps (`pool/file.py`)."""
    fields = key.fmt.encode()
    if max(len(key.chunk_hash), len(key.fingerprint), len(fields)) > _MAX_FIELD:
        raise ValueError("chunk hash or format too long for a chunk header")
    return b"".join((_PREFIX.pack(MAGIC, VERSION, len(key.chunk_hash), len(key.fingerprint),
                                  len(fields), payload_len),
                     key.chunk_hash, key.fingerprint, fields))


def checksum(head: bytes | memoryview, payload: Payload, slice_bytes: int = 0,
             between_slices: Callable[[], None] | None = None) -> int:
    """The header's checksum: xxh3_64 of `head` (`encode_head`), then the payload. With
    `slice_bytes`, the payload is hashed in slices of that size, calling `between_slices`
    before each (a background thread uses it to give way to the request path)."""
    data = as_buffer(payload)
    digest = xxhash.xxh3_64()
    digest.update(head)
    step = slice_bytes or max(data.nbytes, 1)
    for start in range(0, data.nbytes, step):
        if between_slices is not None:
            between_slices()
        digest.update(data[start:start + step])
    return digest.intdigest()


def encode_header(key: ChunkKey, payload: Payload, slice_bytes: int = 0,
                  between_slices: Callable[[], None] | None = None) -> bytes:
    """The header of the object that stores `payload` under `key` (`checksum` says what the
    slices are for)."""
    head = encode_head(key, as_buffer(payload).nbytes)
    return head + _CHECKSUM.pack(checksum(head, payload, slice_bytes, between_slices))


def header_size_of(key: ChunkKey) -> int:
    """The size of the header `encode_header` writes for `key` (whatever the payload)."""
    return PREFIX_SIZE + len(key.chunk_hash) + len(key.fingerprint) + len(key.fmt.encode()) + _CHECKSUM.size


def header_size(prefix: bytes | memoryview) -> int:
    """The full header's size, from its first PREFIX_SIZE bytes (or more)."""
    if len(prefix) < PREFIX_SIZE:
        raise CorruptChunk(f"truncated header ({len(prefix)} bytes)")
    magic, version, hash_len, fp_len, fields_len, _ = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptChunk(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptChunk(f"unsupported version {version}")
    return PREFIX_SIZE + hash_len + fp_len + fields_len + _CHECKSUM.size


def check_header(key: ChunkKey, header: bytes | memoryview) -> int:
    """Check everything in `header` but the checksum against `key`; returns the payload length."""
    size = header_size(header)
    if len(header) != size:
        raise CorruptChunk(f"header is {len(header)} bytes, its prefix says {size}")
    _, _, hash_len, fp_len, fields_len, payload_len = _PREFIX.unpack_from(header)
    view = memoryview(header)
    at = PREFIX_SIZE
    if view[at:at + hash_len] != key.chunk_hash:
        raise CorruptChunk("header names another chunk hash")
    at += hash_len
    fingerprint = bytes(view[at:at + fp_len])
    if fingerprint != key.fingerprint:
        raise CorruptChunk("header names another chunk format (fingerprint)")
    at += fp_len
    try:
        fmt = _decode_format(bytes(view[at:at + fields_len]))
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptChunk(f"undecodable format fields: {e}") from None
    if fmt.fingerprint != fingerprint:
        raise CorruptChunk("format fields do not hash to the header's fingerprint")
    return payload_len


def read_key(header: bytes | memoryview) -> tuple[ChunkKey, int]:
    """The key a header names and its payload length, checking what `check_header` checks but
    the key (the pool adopting its own records after a restart does not know them)."""
    header_size(header)  # magic and version
    _, _, hash_len, fp_len, fields_len, _ = _PREFIX.unpack_from(header)
    view = memoryview(header)
    chunk_hash = bytes(view[PREFIX_SIZE:PREFIX_SIZE + hash_len])
    if not chunk_hash:
        raise CorruptChunk("header names no chunk hash")
    fields_at = PREFIX_SIZE + hash_len + fp_len
    try:
        fmt = _decode_format(bytes(view[fields_at:fields_at + fields_len]))
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptChunk(f"undecodable format fields: {e}") from None
    key = ChunkKey(chunk_hash, fmt)
    return key, check_header(key, header)  # the length, the fingerprint, what the fields hash to


@functools.lru_cache(maxsize=256)
def _decode_format(fields: bytes) -> ChunkFormat:
    """`ChunkFormat.decode`, remembered: every chunk of a rank carries the same fields, and
    decoding them (with the fingerprint's hash) costs more than the rest of the header check."""
    return ChunkFormat.decode(fields)


class PayloadCheck:
    """The checksum of a header that passed `check_header`, checked over the payload as it
    arrives: `update` each piece in order (while it is still in the CPU's cache), then `done`."""

    def __init__(self, header: bytes | memoryview) -> None:
        (self._stored,) = _CHECKSUM.unpack_from(header, len(header) - _CHECKSUM.size)
        self._hash = xxhash.xxh3_64()
        self._hash.update(memoryview(header)[:-_CHECKSUM.size])

    def update(self, piece: memoryview) -> None:
        self._hash.update(piece)

    def done(self) -> None:
        if self._hash.intdigest() != self._stored:
            raise CorruptChunk("checksum mismatch")


def check_payload(header: bytes | memoryview, payload: Payload) -> None:
    """Check the checksum of a header that passed `check_header` over all of `payload`."""
    check = PayloadCheck(header)
    check.update(as_buffer(payload))
    check.done()


def verify(key: ChunkKey, header: bytes | memoryview, payload: Payload) -> None:
    """Raise CorruptChunk unless `header` + `payload` is exactly the object stored under `key`."""
    payload_len = check_header(key, header)
    data = as_buffer(payload)
    if data.nbytes != payload_len:
        raise CorruptChunk(f"payload is {data.nbytes} bytes, the header says {payload_len}")
    check_payload(header, data)


def encode(key: ChunkKey, payload: Payload) -> bytes:
    """The whole object as one blob (header + payload), for a tier that stores single values."""
    return b"".join((encode_header(key, payload), as_buffer(payload)))


def split(key: ChunkKey, blob: bytes | memoryview) -> memoryview:
    """The verified payload of a whole object received as one blob (a view into `blob`)."""
    view = memoryview(blob).cast("B")
    size = header_size(view[:PREFIX_SIZE])
    if view.nbytes < size:
        raise CorruptChunk(f"truncated header ({view.nbytes} of {size} bytes)")
    payload = view[size:]
    verify(key, view[:size], payload)
    return payload
