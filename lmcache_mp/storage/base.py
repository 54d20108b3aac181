"""The storage-tier interface: what every tier below the CPU pool implements.

The daemon keeps KV in tiers. L1 is the CPU memory pool (`pool.py`), which the daemon copies
into and out of workers' caches. Below it, zero or more *lower tiers* (`--l2 URL`, in order:
a local disk directory, Valkey/Redis, a v1 remote server) keep chunks across
daemon restarts, beyond the pool's size, and across machines. The storage manager
(`manager.py`) moves chunks between L1 and the tiers: write-behind after a STORE, read-through
(promotion into L1) during a LOOKUP. Tiers never see the wire protocol or a worker's cache.

A tier's primitives (the seed's backend API, with destination buffers so that bytes are read
straight into pool memory):

    contains(key) -> bool                      is the chunk stored? (cheap: an index or one round trip)
    batched_contains(keys) -> list[bool]       many at once (a network tier pipelines them)
    get(key, out=None) -> Tensor | None        read and verify one chunk (into `out` when given);
                                               None if absent or corrupt (a corrupt one is removed)
    batched_get(keys, outs=None) -> list[...]  many at once, in order
    put(key, kv_chunk, blocking=True)          store one chunk (its bytes as a flat uint8 tensor);
                                               errors are counted and the write skipped, never raised
    batched_put(keys_and_chunks, blocking=True) -> int   many at once; how many were stored
    remove(key)                                forget one chunk
    clear() -> int                             forget every chunk of this deployment (all models);
                                               how many; NotImplementedError where the tier can't
    stats() -> TierStats                       counters for STATUS and /metrics
    close()                                    release files, connections and locks

A tier behind a network (`remote.py`) degrades instead of failing: while its server is
unreachable it answers misses and skips writes, and it retries in the background.

Every tier stores the self-describing object of `chunk_format.py`: a checksummed header that
names the key and the full `ChunkFormat`, then the bytes. A read verifies all of it against
the key asked for, so a tier can never hand back another chunk's or another layout's bytes.

Keys. A `ChunkKey` is a chunk's identity in every tier: the hash of its token prefix and the
`ChunkFormat` that says what its bytes mean (model, world size, rank, layout, dtype, geometry,
chunk size). `ChunkKey.ident` -- `(chunk_hash, fingerprint)` -- is what indexes use.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import msgspec

if TYPE_CHECKING:  # only in annotations: the protocol imports TierStats, and `ping` needs no torch
    import torch


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "fingerprint",
                           hashlib.blake2b(self.encode(), digest_size=16).digest())

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(_FormatFields(
            self.model_name, self.world_size, self.worker_id, self.layout, self.dtype,
            self.num_layers, tuple(self.page_shape), self.chunk_tokens))

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
    def ident(self) -> tuple[bytes, bytes]:
        """`(chunk_hash, fingerprint)`: hashable, cheap, and what the L1 pool keys objects by."""
        return self.chunk_hash, self.fmt.fingerprint

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
    # Network tiers (`remote.py`); a local tier leaves them at their defaults:
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


class StorageTier(ABC):
    """A tier below the CPU pool; see the module docstring for its primitives and contract.

    Thread safety: the manager calls a tier from its writer thread and its reader threads at
    once; every method must be safe to call concurrently.
    """

    # True when `contains` answers from memory without I/O (a local index): the manager may
    # then call it on the socket thread, to answer a LOOKUP that can't be extended at once.
    contains_is_cheap: ClassVar[bool] = False
    # Set by the storage manager: a tier calls it between slices of a long write (write-behind
    # is background work), and it waits, briefly, while the request path copies KV.
    pacer: Callable[[], None] | None = None

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether the tier holds `key` (it may still fail verification when read)."""

    @abstractmethod
    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The chunk's bytes, verified against `key`, as a flat uint8 tensor (`out` itself
        when given, which must be exactly the chunk's size); None if absent, of another size,
        damaged or foreign. A damaged or foreign object is removed and counted as corrupt."""

    def batched_contains(self, keys: Iterable[ChunkKey]) -> list[bool]:
        """`contains` of each key in order (a network tier overrides this to pipeline)."""
        return [self.contains(k) for k in keys]

    def batched_get(self, keys: Iterable[ChunkKey],
                    outs: Iterable[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """`get` of each key in order (a network tier overrides this to pipeline)."""
        keys = list(keys)
        out_list = list(outs) if outs is not None else [None] * len(keys)
        return [self.get(k, o) for k, o in zip(keys, out_list, strict=True)]

    @abstractmethod
    def put(self, key: ChunkKey, kv_chunk: torch.Tensor, blocking: bool = True) -> None:
        """Store `kv_chunk` (a flat uint8 tensor) under `key`, replacing any older object.
        Errors are logged, counted in `write_errors_total` and swallowed: a lower tier is a
        best-effort cache and its failure must never fail a request."""

    def batched_put(self, keys_and_chunks: Iterable[tuple[ChunkKey, torch.Tensor]],
                    blocking: bool = True) -> int:
        """`put` of each pair in order; returns how many are now stored."""
        stored = 0
        for key, chunk in keys_and_chunks:
            self.put(key, chunk, blocking)
            stored += self.contains(key)
        return stored

    @abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """Forget `key` if present."""

    def clear(self) -> int:
        """Forget every chunk this deployment stored here (the tier's whole namespace, every
        model); how many. Writes in flight may land after it."""
        raise NotImplementedError(f"{type(self).__name__} cannot be cleared")

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""

    @abstractmethod
    def close(self) -> None:
        """Release the tier's files, connections and locks. Idempotent."""
