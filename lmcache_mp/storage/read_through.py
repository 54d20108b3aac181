"""Read-through: a LOOKUP's prefix, from L1 and, past its end, from the lower tiers.

A LOOKUP pins what L1 has at once, on the socket thread. If the prefix stops
short and the next chunk may be in a lower tier (tiers with an in-memory index are asked
right there, so a LOOKUP that surely ends is answered at once), the rest is found on a
reader thread: per chunk, every rank's object is taken from L1 or planned to be read from
the first tier that has it into a fresh L1 slot; then each tier reads its share in one
batch and verifies it, and the chunks are committed pinned, so the RETRIEVE that follows is
a plain L1 copy. The prefix stops at the first chunk some rank has nowhere, that finds no
room in L1, or whose read fails. Promotions run on one thread, so two lookups never promote
the same chunk twice; their number in flight is bounded, and past the bound a LOOKUP
answers with what L1 has.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from lmcache_mp.chunks import ChunkFormat, ChunkKey, pool_key
from lmcache_mp.storage.pool.pool import MemoryPool, PoolObject
from lmcache_mp.storage.tiers.base import StorageTier

logger = logging.getLogger(__name__)

# A LOOKUP's result: per leading chunk, one pinned L1 object per rank.
Hits = list[list[PoolObject]]

MAX_PENDING_PROMOTIONS = 256

# What a pool file keeps of each (key, parent's chunk hash or b"", object) committed; None without one.
RecordsFn = Callable[[Iterable[tuple[ChunkKey, bytes, PoolObject]]], list[tuple[bytes, bytes] | None] | None]


@dataclass(frozen=True)
class RankSpec:
    """How one rank stores a chunk: its format, the chunk's size in bytes and in vLLM blocks."""

    fmt: ChunkFormat
    chunk_nbytes: int
    blocks_per_chunk: int = 0


FormatCombo = tuple[RankSpec, ...]  # one per rank, in rank order: the caches of one engine


@dataclass(eq=False)
class _Source:
    """Where one rank's object of a chunk being promoted comes from: `obj` is pinned in L1
    (tier None) or a reserved slot to read from lower tier number `tier`, `filled` once read."""

    key: ChunkKey
    obj: PoolObject
    tier: int | None
    filled: bool = False

    @property
    def ready(self) -> bool:
        return self.tier is None or self.filled


class ReadThrough:
    """LOOKUP over L1 and the lower tiers (module docstring), for the `StorageManager`, which hands
    it the pool, the tiers (with their names), how to note a chunk format met, and what the pool
    file records of a committed chunk."""

    def __init__(self, pool: MemoryPool, tiers: list[StorageTier], names: list[str],
                 know: Callable[[ChunkFormat], None], records: RecordsFn):
        self.pool = pool
        self._tiers = tiers
        self._names = names
        self._know = know
        self._records = records
        self._promotions = [0] * len(tiers)
        self._readers = ThreadPoolExecutor(1, thread_name_prefix="lmcache-mp-read")
        self._pending = 0
        self._lock = threading.Lock()

    def promotions(self, tier_index: int) -> int:
        """Chunks read from lower tier number `tier_index` into L1 so far."""
        with self._lock:
            return self._promotions[tier_index]

    def close(self) -> None:
        """Promotions queued are cancelled (their hits given back); the one running finishes."""
        self._readers.shutdown(wait=True, cancel_futures=True)

    def lookup(self, hashes: list[bytes], combos: list[FormatCombo]) -> Hits | Future[Hits]:
        """The leading chunks present on every rank, pinned (module docstring); a Future when some
        must first be read from a lower tier. `combos`: see `StorageManager.lookup`."""
        hits, best, lengths = self._l1_prefix(hashes, combos)
        if len(hits) == len(hashes) or not self._tiers:
            return hits
        extendable = [i for i, n in enumerate(lengths) if not self._surely_missing(hashes[n], combos[i])]
        if not extendable:
            return hits
        with self._lock:
            if self._pending >= MAX_PENDING_PROMOTIONS:
                return hits  # overloaded: answer with L1's part rather than queue without bound
            self._pending += 1
        if best not in extendable:
            self.pool.unpin([o for chunk in hits for o in chunk])
            hits = []
        handed = hits
        future = self._readers.submit(self._promote, hashes, [combos[i] for i in extendable], handed,
                                      extendable.index(best) if handed else None)
        future.add_done_callback(lambda done: self._if_cancelled(done, handed))
        return future

    def _if_cancelled(self, done: Future[Hits], handed: Hits) -> None:
        """A promotion cancelled at shutdown never ran: give back the hits it was handed."""
        if done.cancelled():
            self.pool.unpin([o for chunk in handed for o in chunk])
            with self._lock:
                self._pending -= 1

    def _surely_missing(self, chunk_hash: bytes, combo: tuple[RankSpec, ...]) -> bool:
        """Whether some rank's object of the chunk after L1's prefix is in no tier, asking only
        tiers that answer from memory: then the LOOKUP is answered at once, without a thread hop."""
        if not all(tier.contains_is_cheap for tier in self._tiers):
            return False
        for spec in combo:
            key = ChunkKey(chunk_hash, spec.fmt)
            if any(tier.contains(key) for tier in self._tiers):
                continue
            in_l1 = self.pool.pin([key.ident])
            if in_l1 is None:
                return True
            self.pool.unpin(in_l1)
        return False

    def _l1_prefix(self, hashes: list[bytes],
                   combos: list[tuple[RankSpec, ...]]) -> tuple[Hits, int, list[int]]:
        """The longest pinned L1 prefix over the format combinations, the index of its
        combination, and every combination's L1 prefix length."""
        best: Hits = []
        best_index = 0
        lengths = []
        for i, combo in enumerate(combos):
            pinned = self._pin_l1_prefix(hashes, combo)
            lengths.append(len(pinned))
            if len(pinned) > len(best) or not i:
                best, pinned, best_index = pinned, best, i
            self.pool.unpin([o for chunk in pinned for o in chunk])
        return best, best_index, lengths

    def _pin_l1_prefix(self, hashes: list[bytes], combo: tuple[RankSpec, ...]) -> Hits:
        # Lazy chains of `pool_key`s, built at C level: a prefix that ends early builds no keys
        # past its end.
        return self.pool.pin_prefix([zip(hashes, itertools.repeat(spec.fmt.fingerprint)) for spec in combo])

    def _promote(self, hashes: list[bytes], combos: list[tuple[RankSpec, ...]], pinned: Hits,
                 pinned_combo: int | None) -> Hits:
        """The longest prefix over `combos`, each extended from L1 or a lower tier; `pinned` is
        combination `pinned_combo`'s L1 prefix, pinned already."""
        best: Hits = []
        best_combo = combos[0]
        try:
            for i, combo in enumerate(combos):
                hits = pinned if i == pinned_combo else self._pin_l1_prefix(hashes, combo)
                if i == pinned_combo:
                    pinned = []  # ours now: released below like the others
                try:
                    hits.extend(self._read_planned(self._plan_promotion(hashes[len(hits):], combo)))
                except BaseException:
                    self.pool.unpin([o for chunk in hits for o in chunk])
                    raise
                if len(hits) > len(best) or not i:
                    best, hits, best_combo = hits, best, combo
                self.pool.unpin([o for chunk in hits for o in chunk])
            for spec in best_combo:
                self.pool.link([pool_key(h, spec.fmt) for h in hashes[:len(best)]])
            return best
        except BaseException:
            self.pool.unpin([o for chunk in best + pinned for o in chunk])
            raise
        finally:
            with self._lock:
                self._pending -= 1

    def _plan_promotion(self, hashes: list[bytes], combo: tuple[RankSpec, ...]) -> list[list[_Source]]:
        """Per following chunk, where each rank's object comes from: pinned in L1 already, or a
        reserved L1 slot to fill from a lower tier. Each tier is asked about every key L1 lacks
        in one batch (a network tier: one round trip). Stops at the first chunk some rank has
        nowhere, or for which L1 has no room (or a STORE is writing it right now)."""
        keys = [[ChunkKey(h, spec.fmt) for spec in combo] for h in hashes]
        pinned = [[self._pin_one(key) for key in chunk] for chunk in keys]
        plan: list[list[_Source]] = []
        try:
            homes = self._find_in_tiers([k for chunk, objs in zip(keys, pinned, strict=True)
                                         for k, obj in zip(chunk, objs, strict=True) if obj is None])
            for chunk, objs in zip(keys, pinned, strict=True):
                sources = self._chunk_sources(chunk, objs, homes, combo)
                if sources is None:
                    break
                plan.append(sources)
        except BaseException:  # a tier's index failed: give back every pin and slot planned
            for planned in plan:
                self._release(planned)
            raise
        finally:  # the pins of chunks past the plan's end
            self.pool.unpin([o for objs in pinned[len(plan):] for o in objs if o is not None])
        return plan

    def _chunk_sources(self, chunk: list[ChunkKey], in_l1: list[PoolObject | None],
                       homes: dict[ChunkKey, int], combo: tuple[RankSpec, ...]) -> list[_Source] | None:
        """One chunk's sources, by rank; None if some rank has it nowhere or L1 has no room for
        it (the slots reserved here are given back; the L1 pins stay the caller's)."""
        sources: list[_Source] = []
        try:
            for key, obj, spec in zip(chunk, in_l1, combo, strict=True):
                if obj is not None:
                    sources.append(_Source(key, obj, tier=None))
                    continue
                tier = homes.get(key)
                slot = self.pool.reserve([key.ident], spec.chunk_nbytes)[0] if tier is not None else None
                if not isinstance(slot, PoolObject):
                    self.pool.abort([src.obj for src in sources if src.tier is not None])
                    return None
                sources.append(_Source(key, slot, tier))
        except BaseException:
            self.pool.abort([src.obj for src in sources if src.tier is not None])
            raise
        return sources

    def _pin_one(self, key: ChunkKey) -> PoolObject | None:
        in_l1 = self.pool.pin([key.ident])
        return in_l1[0] if in_l1 is not None else None

    def _find_in_tiers(self, keys: list[ChunkKey]) -> dict[ChunkKey, int]:
        """The first lower tier (by index) that holds each key; keys held nowhere are left out."""
        homes: dict[ChunkKey, int] = {}
        for index, tier in enumerate(self._tiers):
            if not keys:
                break
            found = tier.batched_contains(keys)
            homes.update((k, index) for k, there in zip(keys, found, strict=True) if there)
            keys = [k for k, there in zip(keys, found, strict=True) if not there]
        return homes

    def _read_planned(self, plan: list[list[_Source]]) -> Hits:
        """Fill the planned slots, each tier's in one batch (a tier overlaps or pipelines its
        reads as it can); the chunks up to the first one with a failed read, pinned."""
        reads = [src for chunk in plan for src in chunk if src.tier is not None]
        for tier_index, tier in enumerate(self._tiers):
            mine = [src for src in reads if src.tier == tier_index]
            if not mine:
                continue
            try:
                got = tier.batched_get([src.key for src in mine], [src.obj.data for src in mine])
            except Exception:
                logger.exception("reading from %s failed; counted as misses", self._names[tier_index])
                got = [None] * len(mine)
            for src, data in zip(mine, got, strict=True):
                src.filled = data is not None
        done: Hits = []
        for i, chunk in enumerate(plan):
            if not all(src.ready for src in chunk):
                for rest in plan[i:]:
                    self._release(rest)
                break
            if not self._publish(chunk):
                for rest in plan[i + 1:]:
                    self._release(rest)
                break
            done.append([src.obj for src in chunk])
        return done

    def _publish(self, chunk: list[_Source]) -> bool:
        """Commit a chunk's freshly read slots, pinned like its L1 objects already are; False, with
        the chunk's pins given back, if its model was dropped while they were read (`drop_models`)."""
        fresh = [src for src in chunk if src.tier is not None]
        for src in fresh:
            self._know(src.key.fmt)
        committed = self.pool.commit([src.obj for src in fresh], pin=True,
                                     records=self._promoted_records(fresh))
        with self._lock:
            for src in fresh:
                self._promotions[src.tier] += 1  # type: ignore[index]
        if len(committed) == len(fresh):
            return True
        self.pool.unpin([src.obj for src in chunk if src.tier is None] + committed)
        return False

    def _promoted_records(self, fresh: list[_Source]) -> list[tuple[bytes, bytes] | None] | None:
        return self._records((src.key, b"", src.obj) for src in fresh)  # their parents: linked later

    def _release(self, chunk: list[_Source]) -> None:
        """Give back what a planned chunk holds: pins on L1 objects; slots that were read are
        kept as unpinned L1 objects (valid, just not leased), the others aborted."""
        self.pool.unpin([src.obj for src in chunk if src.tier is None])
        reads = [src for src in chunk if src.tier is not None]
        self.pool.abort([src.obj for src in reads if not src.filled])
        filled = [src for src in reads if src.filled]
        self.pool.commit([src.obj for src in filled], records=self._promoted_records(filled))
