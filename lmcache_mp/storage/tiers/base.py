"""The storage-tier interface: what every tier below the CPU pool implements.

The daemon keeps KV in tiers. L1 is the CPU memory pool (`pool.py`), which the daemon copies
into and out of workers' caches. Below it, zero or more *lower tiers* (`--l2 URL`, in order:
a local disk directory, Valkey/Redis, a v1 remote server, S3, Mooncake Store) keep chunks across
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
    drop_models(models) -> int                 forget every chunk of these models (every rank and
                                               layout), no other; how many; NotImplementedError or
                                               OSError where the tier can't
    announce(resync)                           tell `events` every chunk it holds, in the pass's
                                               slices (a tier with an index; a network tier holds
                                               no list and tells none)
    share_memory(memory)                       the pool's memory, for a tier that registers it
                                               with a transfer engine (Mooncake); others ignore it
    stats() -> TierStats                       counters for STATUS and /metrics
    close()                                    release files, connections and locks

A tier behind a network (`remote.py`) degrades instead of failing: while its server is
unreachable it answers misses and skips writes, and it retries in the background.

Every tier stores the self-describing object of `chunk_format.py`: a checksummed header that
names the key and the full `ChunkFormat`, then the bytes. A read verifies all of it against
the key asked for, so a tier can never hand back another chunk's or another layout's bytes.

Keys. A `ChunkKey` (`lmcache_mp/chunks.py`, the chunk vocabulary) is a chunk's identity in every
tier: the hash of its token prefix and the `ChunkFormat` that says what its bytes mean.
`ChunkKey.ident` -- the pool key `(chunk_hash, fingerprint)` -- is what indexes use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Set
from typing import TYPE_CHECKING, ClassVar

from lmcache_mp.chunks import ChunkKey, TierStats
from lmcache_mp.kv_events.log import SourceEvents
from lmcache_mp.kv_events.resync import Pass

if TYPE_CHECKING:  # only in annotations: tiers are opened by URL, and their modules load torch themselves
    import torch


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
    # Set by the storage manager: where the tier tells what it gains and loses (`kv_events`), as
    # it happens (under its own lock, where it has one, so that the order is the tier's).
    events: SourceEvents | None = None

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

    def drop_models(self, models: Set[str]) -> int:
        """Forget every chunk stored here whose format names one of `models` (`ChunkFormat.model_name`),
        whatever its rank, world size or layout, and no other; how many. Once it returns, no read
        finds one (the storage manager has stopped its writes of them first). Raises
        NotImplementedError where the tier cannot, OSError where it failed: what it could not
        drop may still be served, so the caller must not report them gone."""
        raise NotImplementedError(f"{type(self).__name__} cannot drop a model's chunks")

    def announce(self, resync: Pass) -> None:  # noqa: B027 (a default, not an abstract method)
        """Tell `events` that every chunk the tier holds is stored (a resync), in `resync.slices`
        (a snapshot of its keys, the lock held for one slice at a time). A tier with no list of its
        chunks tells nothing: its stream carries the writes and removals it makes."""

    def share_memory(self, memory: torch.Tensor) -> None:  # noqa: B027 (a default, not an abstract method)
        """The pool's whole memory (a flat uint8 tensor), given once after the pool is made: a tier
        whose client moves bytes by DMA registers it, so that writes go straight from pool slots.
        Must not raise for a failing network; the others ignore it."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""

    @abstractmethod
    def close(self) -> None:
        """Release the tier's files, connections and locks. Idempotent."""
