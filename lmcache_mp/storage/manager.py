"""The storage manager: the CPU pool (L1) and the lower tiers, as one store of chunks.

The engine sees storage only through these primitives:

    reserve(fmt, hashes, nbytes, parent) -> [PoolObject | ReserveFailure]
                                               L1 slots a STORE copies into
    commit_store(fmt, hashes, slots, parent)   make them visible, link the prefix chain, and
                                               queue them for the lower tiers (write-behind)
    abort(objects)                             a STORE's copy failed: free its slots
    lookup(hashes, combos) -> Hits | Future[Hits]
                                               the leading chunks present on every rank (in the
                                               formats of one of the combos), pinned
                                               in L1; a Future when some must first be read
                                               from a lower tier (read-through)
    pin(keys) / unpin(objects) / repin(objects) a RETRIEVE reads L1 only; leases hold pins
    clear() -> int                             drop L1's unpinned objects (lower tiers stay)
    clear_tiers() -> [TierCleared]             empty every lower tier's namespace
    drop_models(models) -> (int, [TierCleared]) every chunk of these models out of L1 and each
                                               lower tier (a reset: see "Dropping a model")
    admit(nbytes)                              ValueError if L1 can never hold a chunk of nbytes
    resync()                                   the event log starts over: AllBlocksCleared now, then
                                               every chunk L1 and the indexed tiers hold, on the
                                               resync thread (`kv_events/resync.py`)
    stats() -> (PoolStats, [TierStats])      pool_stats(): the first alone
    open(l1_bytes, tier_urls, ...)             build the pool (in its pool file, adopting what that
                                               holds: warm restart) and open the tiers
    close()                                    finish queued writes (bounded), release the tiers,
                                               then the pool

Write-behind: a committed chunk is pinned and offered to each lower tier's `TierWriter`,
which writes it off the request path and unpins it; a full queue skips the chunk (counted).

Events: given a `kv_events.EventLog`, L1 and every tier record there what becomes readable in
them and what stops being so; a start announces the indexed tiers' chunks on the resync thread
(a disk tier reads the key of each file it found from its header), where every resync's
announcements also run, in slices paced by the publisher (`kv_events/resync.py`).

Read-through (`read_through.py`): a LOOKUP pins what L1 has at once; where the prefix may go on in
a lower tier, the rest is read into L1 on a reader thread, and the LOOKUP's answer is a Future.

Dropping a model (its weights changed): no chunk of it may be found once `drop_models` returns,
nor come back. In order: L1 drops them (`pool/drop.py`: those in use are hidden, freed once released;
writes in progress are freed at their commit, and write-behind skips them); each writer forgets
its queued ones and waits for the batch it is writing; each tier drops them; L1 drops once more
what a promotion read from a tier before the tier dropped it. Then the event log resyncs, as after
CLEAR (network tiers keep no list, so their removals are told that way).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Hashable, Iterable, Set
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from lmcache_mp.chunks import ChunkFormat, ChunkKey, PoolKey, TierCleared, TierStats, pool_key
from lmcache_mp.kv_events.log import EventLog, Residence, SourceEvents
from lmcache_mp.kv_events.resync import Resync
from lmcache_mp.storage.chunk_format import encode_head
from lmcache_mp.storage.pool.file import open_pool_file
from lmcache_mp.storage.pool.integrity import PoolIntegrity
from lmcache_mp.storage.pool.memory import PinFn
from lmcache_mp.storage.pool.pool import MemoryPool, PoolObject, PoolStats, ReserveFailure
from lmcache_mp.storage.read_through import FormatCombo, Hits, ReadThrough
from lmcache_mp.storage.tiers.base import StorageTier
from lmcache_mp.storage.tiers.open import open_tier
from lmcache_mp.storage.tiers.urls import redact_url
from lmcache_mp.storage.write_behind import CopyGate, TierWriter

logger = logging.getLogger(__name__)

SHUTDOWN_FLUSH_S = 10.0
SHUTDOWN_SEAL_S = 10.0  # a clean stop checksums the pool file's newest chunks for up to this long




def _residence(tier_name: str) -> Residence:
    """Where a lower tier's chunks are, in vLLM's event terms: a disk is this machine's storage,
    the others are a network's."""
    return Residence("STORAGE", "LOCAL" if tier_name.startswith("disk://") else "REMOTE", tier_name)


class StorageManager:
    """L1 and the lower tiers as one store of chunks (see the module docstring): the engine's only
    door to storage. It owns the pool and the tiers it is given, and closes them."""

    def __init__(self, pool: MemoryPool, tiers: list[tuple[str, StorageTier]], write_queue_bytes: int,
                 events: EventLog | None = None):
        self.pool = pool
        self._events = events
        self._tiers = [tier for _, tier in tiers]
        self._names = [name for name, _ in tiers]
        self._writers = [TierWriter(tier, name, write_queue_bytes, pool.unpin, pool.doomed)
                         for name, tier in tiers]
        # What each format fingerprint met here means (`drop_models` matches L1's keys by model).
        self._formats: dict[bytes, ChunkFormat] = {}
        self._gate = CopyGate()
        for tier in self._tiers:
            tier.pacer = self._gate.wait_for_gap
        # The engine wraps its copies in this, so that background writes give way to them.
        self.copying = self._gate.copying
        # A pool in a pool file: its records are written at commit, its checksums by this.
        self._integrity = PoolIntegrity(pool, self._gate.wait_for_gap) if pool.stats().pool_file else None
        self._read_through = ReadThrough(pool, self._tiers, self._names, self._know, self._records)
        self._resync: Resync | None = None
        if events is not None:
            for tier in self._tiers:
                tier.events = SourceEvents(events, _residence(tier.stats().name))
            announcers = [(name, tier.announce) for name, tier in zip(self._names, self._tiers, strict=True)]
            self._resync = Resync(events, [("pool", pool.announce), *announcers], first=announcers)

    @classmethod
    def open(cls, l1_bytes: int, tier_urls: list[str], write_queue_bytes: int, pin: PinFn | None,
             pool_file: Path | None = None, fresh_pool: bool = False,
             events: EventLog | None = None) -> StorageManager:
        """The daemon's storage: a pool of `l1_bytes` (its memory prepared in the background, so
        the daemon answers at once for any size; each prepared piece handed to `pin`, where
        CUDA is present) and a tier per URL, in order. With `pool/file.py`, the pool lives in that
        file and adopts what it holds, unless `fresh_pool` (`file.open_pool_file`: the pool
        may still end up in anonymous memory, or that raises PoolFileError). ValueError on a bad
        URL, with whatever was opened closed again. `events`: see the module docstring."""
        tiers: list[tuple[str, StorageTier]] = []
        pool: MemoryPool | None = None
        try:
            for url in tier_urls:
                tiers.append((redact_url(url), open_tier(url)))
            # The pool file after the tiers: a start that fails on a tier leaves no new file behind.
            # Page-aligned objects: the disk tier writes them with direct I/O, straight from the pool.
            backing = None if pool_file is None else open_pool_file(pool_file, l1_bytes, mmap.PAGESIZE,
                                                                      fresh=fresh_pool)
            pool = MemoryPool(l1_bytes, align=mmap.PAGESIZE, background=True, pin=pin, backing=backing,
                              events=events)
            for _, tier in tiers:
                tier.share_memory(pool.memory)
            return cls(pool, tiers, write_queue_bytes, events)
        except BaseException:
            for _, tier in tiers:
                tier.close()
            if pool is not None:
                pool.close()
            raise

    # ---- STORE --------------------------------------------------------------------------------

    def reserve(self, fmt: ChunkFormat, hashes: list[bytes], nbytes: int,
                parent: bytes | None) -> list[PoolObject | ReserveFailure]:
        """L1 slots for a STORE of one rank's chain of chunks (`parent`: the chunk before the
        first, when known). The chain's live part is refreshed first, so that the evictions
        this reserve may cause never take the prefix it extends."""
        keys, parent_key = self._chain(fmt, hashes, parent)
        self.pool.link(keys, parent=parent_key)
        self._know(fmt)
        return self.pool.reserve(keys, nbytes)

    def _know(self, fmt: ChunkFormat) -> None:
        if fmt.fingerprint not in self._formats:
            self._formats[fmt.fingerprint] = fmt
        if self._events is not None:
            self._events.know(fmt)

    def abort(self, objects: list[PoolObject]) -> None:
        self.pool.abort(objects)

    def commit_store(self, fmt: ChunkFormat, hashes: list[bytes], slots: list[PoolObject | ReserveFailure],
                     parent: bytes | None) -> None:
        """Publish a STORE's filled slots (in chunk order, failures included) and queue them; slots
        of a model dropped meanwhile (`drop_models`) are freed instead."""
        parents = [parent or b"", *hashes[:-1]]  # each chunk's, as the pool file keeps it
        fresh = [(ChunkKey(h, fmt), p, s) for h, s, p in zip(hashes, slots, parents, strict=True)
                 if isinstance(s, PoolObject)]
        objects = [obj for _, _, obj in fresh]
        keys, parent_key = self._chain(fmt, hashes, parent)
        self.pool.link(keys, parent=parent_key)  # now with the new chunks in the chain
        # A queued chunk stays pinned, one pin per tier's queue, all taken before any is given
        # back: a chunk left with no pin could be evicted before the next queue takes it.
        committed = self.pool.commit(objects, pin=bool(self._writers), records=self._records(fresh))
        if len(committed) < len(objects):
            kept = set(committed)
            fresh = [chunk for chunk in fresh if chunk[2] in kept]
            objects = committed
        if self._integrity is not None:
            self._integrity.poke()
        for _ in self._writers[1:]:
            self.pool.repin(objects)
        for writer in self._writers:
            for key, _, obj in fresh:
                if not writer.offer(key, obj):
                    self.pool.unpin([obj])

    def _records(self, chunks: Iterable[tuple[ChunkKey, bytes, PoolObject]]
                 ) -> list[tuple[bytes, bytes] | None] | None:
        """What a pool file keeps of each (key, parent's chunk hash or b"", object) committed:
        the parent's hash and the chunk head; None without a pool file."""
        if self._integrity is None:
            return None
        return [(parent, encode_head(key, obj.nbytes)) for key, parent, obj in chunks]

    @staticmethod
    def _chain(fmt: ChunkFormat, hashes: list[bytes],
               parent: bytes | None) -> tuple[list[PoolKey], PoolKey | None]:
        return [pool_key(h, fmt) for h in hashes], pool_key(parent, fmt) if parent is not None else None

    # ---- LOOKUP -------------------------------------------------------------------------------

    def lookup(self, hashes: list[bytes], combos: list[FormatCombo]) -> Hits | Future[Hits]:
        """See `read_through.py`. `combos` holds, for each kind of cache registered on every rank
        (one, unless engines of several layouts share the model), its format per rank; each is
        tried."""
        return self._read_through.lookup(hashes, combos)


    # ---- RETRIEVE, CLEAR, status, lifecycle ---------------------------------------------------

    def holds(self, fmt: ChunkFormat, hashes: list[bytes]) -> list[bool]:
        """Which of a rank's chunks the pool holds now (no tier is asked, nothing pinned)."""
        return self.pool.holds(self._chain(fmt, hashes, None)[0])

    def pin(self, keys: list[Hashable]) -> list[PoolObject] | None:
        return self.pool.pin(keys)

    def unpin(self, objects: list[PoolObject]) -> None:
        self.pool.unpin(objects)

    def discard(self, keys: list[Hashable]) -> int:
        """Free these chunks from the pool where nobody holds them (lower tiers keep theirs)."""
        return self.pool.discard(keys)

    def repin(self, objects: list[PoolObject]) -> None:
        """One more pin on each object, pinned already (a chunk leased to several ranks)."""
        self.pool.repin(objects)

    def admit(self, nbytes: int) -> None:
        """ValueError, naming the largest object L1 can hold, if it can never hold `nbytes`."""
        self.pool.admit(nbytes)

    def clear(self) -> int:
        cleared = self.pool.clear()
        self.resync()
        return cleared

    def resync(self) -> None:
        """See the module docstring; a no-op without an event log."""
        if self._resync is not None:
            self._resync.request()

    def resync_counters(self) -> dict[str, int]:
        """Resync passes finished, and 1 while one is asked for or running (`kv_events/resync.py`)."""
        return self._resync.counters() if self._resync is not None else {"resyncs_total": 0, "resyncing": 0}

    def clear_tiers(self) -> list[TierCleared]:
        results = []
        for tier in self._tiers:
            name = tier.stats().name
            try:
                results.append(TierCleared(name, removed=tier.clear()))
            except (NotImplementedError, OSError) as e:
                results.append(TierCleared(name, error=str(e)))
        self.resync()
        return results

    def drop_models(self, models: Set[str]) -> tuple[int, list[TierCleared]]:
        """Every chunk of `models` (every rank, world size and layout), no other, out of L1 and each
        lower tier, in the order the module docstring gives: the objects L1 dropped, and per tier
        what it removed or why it could not (its chunks of them may then still be served)."""
        dropped = self.pool.drop(self._of_models(models))
        tiers = [self._drop_from_tier(i, models) for i in range(len(self._tiers))]
        if self._tiers:
            dropped += self.pool.drop(self._of_models(models))
        self.resync()
        return dropped, tiers

    def _of_models(self, models: Set[str]) -> Callable[[Hashable], bool]:
        """Whether an L1 key is of one of `models`, by its fingerprint (formats met here, or that
        the event log learned: a warm restart's adopted chunks)."""
        verdicts: dict[bytes, bool] = {}

        def of_models(key: Hashable) -> bool:
            _, fingerprint = key  # type: ignore[misc]
            verdict = verdicts.get(fingerprint)
            if verdict is None:
                fmt = self._formats.get(fingerprint)
                if fmt is None and self._events is not None:
                    fmt = self._events.format_of(fingerprint)
                verdict = verdicts[fingerprint] = fmt is not None and fmt.model_name in models
            return verdict
        return of_models

    def _drop_from_tier(self, index: int, models: Set[str]) -> TierCleared:
        name = self._names[index]
        try:
            if not self._writers[index].drop_models(models, SHUTDOWN_FLUSH_S):
                raise OSError(f"a write to it outlasted {SHUTDOWN_FLUSH_S:g} s; its chunks of the model "
                              "may still land: reset again")
            return TierCleared(name, removed=self._tiers[index].drop_models(models))
        except (NotImplementedError, OSError) as e:
            return TierCleared(name, error=str(e))

    def pool_stats(self) -> PoolStats:
        return self.pool.stats()

    def stats(self) -> tuple[PoolStats, list[TierStats]]:
        tiers = []
        for i, (tier, writer) in enumerate(zip(self._tiers, self._writers, strict=True)):
            chunks, nbytes = writer.depth()
            tiers.append(replace(tier.stats(), promotions_total=self._read_through.promotions(i),
                                 write_queue_chunks=chunks,
                                 write_queue_bytes=nbytes, skipped_writes_total=writer.skipped_total))
        return self.pool.stats(), tiers

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write is done (tests, benchmarks, shutdown)."""
        return all(writer.flush(timeout_s) for writer in self._writers)

    def close(self) -> None:
        """Idempotent. The pool last: the tiers' writers copy out of it until they are closed."""
        self._read_through.close()
        if self._resync is not None:
            self._resync.close()
        for writer in self._writers:
            writer.close(SHUTDOWN_FLUSH_S)
        for tier in self._tiers:
            tier.close()
        if self._integrity is not None:
            self._integrity.close(SHUTDOWN_SEAL_S)
            self._integrity = None
        self.pool.close()
