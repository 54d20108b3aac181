"""The chunk vocabulary: what a stored chunk is called, wherever it is.

A chunk's identity is the hash of its token prefix and the `ChunkFormat` that says what its
bytes mean (model, world size, rank, layout, dtype, geometry, chunk size): bytes stored by one
kind of cache are never read into another. Two spellings of that identity, one per use:

    ChunkKey(chunk_hash, fmt)          in every lower tier (and in `chunk_format.py`'s headers)
    PoolKey = (chunk_hash, fingerprint) in the L1 pool: a plain tuple, because the pool's
                                       C-level prefix walk hashes millions of them; made only by
                                       `pool_key` (or `ChunkKey.ident`, which calls it)

The wire key (`custom_types.IPCCacheEngineKey`) is a client's name for a chunk; `keys.py` maps
it to chunk hashes. Also here: each tier's counters (`TierStats`) and what CLEAR_TIERS did
(`TierCleared`), which STATUS and the CLI show. Plain data, no torch: the wire protocol imports
this module, not the storage package.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec

PoolKey = tuple[bytes, bytes]  # (chunk hash, format fingerprint): a chunk's key in the L1 pool


def pool_key(chunk_hash: bytes, fmt: ChunkFormat) -> PoolKey:
    """The chunk's key in the L1 pool (the only place that spells it)."""
    return chunk_hash, fmt.fingerprint


def chunk_hash_of(key: PoolKey) -> bytes:
    """The chunk hash of a pool key: `pool_key`'s inverse, for the rank-free questions
    (RELEASE_LEASES names chunks, not ranks)."""
    return key[0]


class _FormatFields(msgspec.Struct, array_like=True, frozen=True):
    model_name: str
    world_size: int
    worker_id: int
    layout: str
    dtype: str
    num_layers: int
    page_shape: tuple[int, ...]
    chunk_tokens: int


@dataclass(frozen=True)
class ChunkFormat:
    """What a stored chunk's bytes mean. Two caches whose formats differ never share a chunk."""

    model_name: str
    world_size: int
    worker_id: int
    layout: str  # the layout's name in transfer/layouts.py
    dtype: str  # torch dtype name, e.g. "bfloat16"
    num_layers: int
    page_shape: tuple[int, ...]  # one block of one layer
    chunk_tokens: int  # tokens per chunk (the daemon's --chunk-size)
    # 16-byte digest of everything above: deterministic across processes, restarts, machines.
    fingerprint: bytes = field(init=False, repr=False, compare=False)
    # Everything above but the fingerprint, encoded once: every stored chunk's header carries it.
    _encoded: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        encoded = msgspec.msgpack.encode(_FormatFields(
            self.model_name, self.world_size, self.worker_id, self.layout, self.dtype,
            self.num_layers, tuple(self.page_shape), self.chunk_tokens))
        object.__setattr__(self, "_encoded", encoded)
        object.__setattr__(self, "fingerprint", hashlib.blake2b(encoded, digest_size=16).digest())

    def encode(self) -> bytes:
        return self._encoded

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ChunkFormat:
        """Raises msgspec.DecodeError / ValidationError on bytes that are not a format."""
        f = msgspec.msgpack.decode(data, type=_FormatFields)
        return cls(f.model_name, f.world_size, f.worker_id, f.layout, f.dtype, f.num_layers,
                   tuple(f.page_shape), f.chunk_tokens)


@dataclass(frozen=True, eq=False, slots=True)
class ChunkKey:
    """A chunk's identity in every tier (the successor of the seed's `ObjectKey`)."""

    chunk_hash: bytes
    fmt: ChunkFormat

    @property
    def fingerprint(self) -> bytes:
        return self.fmt.fingerprint

    @property
    def ident(self) -> PoolKey:
        """`pool_key(chunk_hash, fmt)`: hashable, cheap, and what indexes key objects by."""
        return pool_key(self.chunk_hash, self.fmt)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkKey) and self.ident == other.ident

    def __hash__(self) -> int:
        return hash(self.ident)


@dataclass
class TierStats:
    """Counters of one tier. Cumulative counters end in `_total`; the rest are levels."""

    name: str  # e.g. "disk:///var/cache/lmcache-mp" (never a password)
    objects: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits_total: int = 0  # gets that returned a verified chunk
    misses_total: int = 0  # gets of absent chunks
    corrupt_total: int = 0  # objects found damaged, foreign or mislabelled, and removed
    writes_total: int = 0  # chunks stored
    write_errors_total: int = 0  # writes skipped on an error (ENOSPC, EIO, ...)
    evictions_total: int = 0  # objects removed to stay within capacity
    # Network tiers (`storage/remote.py`); a local tier leaves them at their defaults:
    up: int = 1  # 0 while the tier is unreachable (treated as empty, retried in the background)
    errors_total: int = 0  # operations that failed (timeout, connection lost, server error)
    unavailable_total: int = 0  # chunks answered as misses or writes skipped while down
    read_bytes_total: int = 0  # payload bytes read and verified
    written_bytes_total: int = 0  # payload bytes written
    read_latency_p50_ms: float = 0.0  # over the last READ/WRITE operations (one batch each)
    read_latency_p99_ms: float = 0.0
    write_latency_p50_ms: float = 0.0
    write_latency_p99_ms: float = 0.0
    # Filled in by the storage manager, not the tier:
    promotions_total: int = 0  # chunks read from this tier into L1 for a LOOKUP
    write_queue_chunks: int = 0  # write-behind chunks waiting for this tier
    write_queue_bytes: int = 0
    skipped_writes_total: int = 0  # chunks not queued for this tier because its queue was full


@dataclass
class TierCleared:
    """What CLEAR_TIERS did to one tier: objects removed, or why it could not clear."""

    name: str
    removed: int = 0
    error: str = ""
