"""The storage manager in process, with a real MemoryPool and real DiskTiers in tmp directories:
STORE (reserve, fill, commit_store) and write-behind, full write queues, read-through promotion
on LOOKUP (one and two ranks, L1 and disk combined, corrupt and failed reads), the pending
promotion bound, close(), and concurrent stores and lookups.

A few tests need a tier to do something a DiskTier can't do on demand (hold its writes or reads
until released, fail its reads); they use minimal DiskTier subclasses that add only that."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmcache_mp.chunks import ChunkFormat, ChunkKey, TierStats
from lmcache_mp.storage import manager as manager_module
from lmcache_mp.storage import read_through
from lmcache_mp.storage.manager import StorageManager
from lmcache_mp.storage.pool.pool import MemoryPool, ObjectState, PoolObject, ReserveFailure
from lmcache_mp.storage.read_through import FormatCombo, Hits, RankSpec
from lmcache_mp.storage.tiers.disk import DiskTier, object_name

KiB = 1024
MiB = 1024 * KiB
NBYTES = 4 * KiB  # one chunk of one rank
DISK_BYTES = 64 * MiB
WAIT_S = 10.0  # upper bound on any wait for a background thread; never reached when all is well

SOLO = ChunkFormat("test-model", 1, 0, "vllm_flash", "bfloat16", 2, (2, 4, 8, 16), 16)
RANK0 = ChunkFormat("test-model", 2, 0, "vllm_flash", "bfloat16", 2, (2, 4, 8, 16), 16)
RANK1 = replace(RANK0, worker_id=1)


def h(i: int, ns: int = 0) -> bytes:
    """The chunk hash of chunk `i` of test chain `ns`."""
    return ns.to_bytes(8, "big") + i.to_bytes(8, "big")


def hashes(n: int, ns: int = 0, start: int = 0) -> list[bytes]:
    return [h(i, ns) for i in range(start, start + n)]


def expected(chunk_hash: bytes, fmt: ChunkFormat, nbytes: int = NBYTES) -> torch.Tensor:
    """The bytes every STORE of this chunk of this rank writes (a pure function of the key)."""
    seed = int.from_bytes(hashlib.blake2b(chunk_hash + fmt.fingerprint, digest_size=8).digest(), "big")
    gen = torch.Generator().manual_seed(seed & (2**63 - 1))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def ident(chunk_hash: bytes, fmt: ChunkFormat) -> tuple[bytes, bytes]:
    return ChunkKey(chunk_hash, fmt).ident


def store(mgr: StorageManager, fmt: ChunkFormat, chain: list[bytes], parent: bytes | None = None,
          nbytes: int = NBYTES) -> list[PoolObject | ReserveFailure]:
    """One rank's STORE as the engine does it: reserve, fill the fresh slots, commit_store."""
    slots = mgr.reserve(fmt, chain, nbytes, parent)
    for chunk_hash, slot in zip(chain, slots, strict=True):
        if isinstance(slot, PoolObject):
            assert slot.state is ObjectState.WRITING
            slot.data.copy_(expected(chunk_hash, fmt, nbytes))
    mgr.commit_store(fmt, chain, slots, parent)
    return slots


def resolve(result: Hits | Future[Hits]) -> Hits:
    return result.result(timeout=WAIT_S) if isinstance(result, Future) else result


def flat(hits: Hits) -> list[PoolObject]:
    return [obj for chunk in hits for obj in chunk]


def release(mgr: StorageManager, hits: Hits) -> None:
    """Unpin every hit of a lookup; then nothing in the pool may stay pinned."""
    mgr.unpin(flat(hits))
    assert mgr.stats()[0].num_pinned == 0


def only_on_disk(mgr: StorageManager) -> int:
    """Wait until every queued write is done, then drop L1: the chunks live on disk only.
    Returns how many objects L1 dropped."""
    assert mgr.flush(WAIT_S)
    return mgr.clear()


def assert_hits(hits: Hits, chain: list[bytes], fmts: list[ChunkFormat]) -> None:
    """Every hit is READY, pinned, and holds the bytes stored for its chunk and rank."""
    assert len(hits) <= len(chain)
    for chunk_hash, chunk in zip(chain, hits, strict=False):
        assert len(chunk) == len(fmts)
        for obj, fmt in zip(chunk, fmts, strict=True):
            assert obj.key == ident(chunk_hash, fmt)
            assert obj.state is ObjectState.READY and obj.pins >= 1
            assert torch.equal(obj.data, expected(chunk_hash, fmt, obj.nbytes))


def specs(*fmts: ChunkFormat, nbytes: int = NBYTES) -> list[FormatCombo]:
    """`combos` for a lookup: one kind of cache, of these formats on its ranks."""
    return [tuple(RankSpec(fmt, nbytes) for fmt in fmts)]


def tier_stats(mgr: StorageManager, i: int = 0) -> TierStats:
    return mgr.stats()[1][i]


def file_of(tier: DiskTier, key: ChunkKey) -> Path:
    name = object_name(key)
    return tier.root / name[:2] / f"{name}.kv"


def wait_until(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class GatedDiskTier(DiskTier):
    """A real DiskTier whose writes (`gate_writes`) and/or batched reads (`gate_reads`) wait at a
    gate until `gate.set()`: a tier that is busy for as long as a test needs."""

    def __init__(self, root: Path, capacity_bytes: int, *, gate_writes: bool = False,
                 gate_reads: bool = False) -> None:
        super().__init__(root, capacity_bytes)
        self.gate = threading.Event()
        self.waiting = threading.Event()  # a write or read has reached the gate
        self._gate_writes = gate_writes
        self._gate_reads = gate_reads

    def _pass_gate(self) -> None:
        self.waiting.set()
        self.gate.wait(WAIT_S)

    def put(self, key: ChunkKey, kv_chunk: torch.Tensor, blocking: bool = True) -> None:
        if self._gate_writes:
            self._pass_gate()
        super().put(key, kv_chunk, blocking)

    def batched_get(self, keys, outs=None):
        if self._gate_reads:
            self._pass_gate()
        return super().batched_get(keys, outs)


class FailingReadsTier(DiskTier):
    """A real DiskTier whose batched reads raise (an I/O error a network tier might throw)."""

    def batched_get(self, keys, outs=None):
        raise OSError("injected read failure")


class FailingIndexTier(DiskTier):
    """A real DiskTier whose `contains` raises for the keys in `failing` (a lost connection), as
    a network tier's could; like one, it doesn't claim an in-memory index."""

    contains_is_cheap = False

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        super().__init__(root, capacity_bytes)
        self.failing: set[ChunkKey] = set()

    def contains(self, key: ChunkKey) -> bool:
        if key in self.failing:
            raise ConnectionError("injected index failure")
        return super().contains(key)


@pytest.fixture
def make(disk):
    """make(*tiers, pool_bytes=..., write_queue_bytes=...) -> a StorageManager closed at teardown
    (before the `disk` fixture closes its tiers: it depends on it for that order)."""
    managers: list[StorageManager] = []
    gated: list[GatedDiskTier] = []

    def _make(*tiers: DiskTier, pool_bytes: int = MiB, write_queue_bytes: int = MiB) -> StorageManager:
        mgr = StorageManager(MemoryPool(pool_bytes), [(f"tier{i}", t) for i, t in enumerate(tiers)],
                             write_queue_bytes)
        managers.append(mgr)
        gated.extend(t for t in tiers if isinstance(t, GatedDiskTier))
        return mgr

    yield _make
    for tier in gated:
        tier.gate.set()  # never leave a writer or reader thread waiting
    for mgr in managers:
        mgr.close()


@pytest.fixture
def disk(tmp_path: Path):
    """disk(name, cls=DiskTier, **kw) -> a tier in tmp_path/name (closed by its manager, or here)."""
    tiers: list[DiskTier] = []

    def _disk(name: str = "disk", cls: type[DiskTier] = DiskTier, **kw) -> DiskTier:
        tier = cls(tmp_path / name, DISK_BYTES, **kw)
        tiers.append(tier)
        return tier

    yield _disk
    for tier in tiers:
        if isinstance(tier, GatedDiskTier):
            tier.gate.set()
        tier.close()


# ---- STORE and write-behind ---------------------------------------------------------------------


def test_store_is_visible_in_l1_written_behind_and_released(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(6)
    slots = store(mgr, SOLO, chain)
    assert all(isinstance(s, PoolObject) for s in slots)

    objects = mgr.pin([ident(x, SOLO) for x in chain])  # visible in L1 at once
    assert objects is not None and [o.key for o in objects] == [ident(x, SOLO) for x in chain]
    assert all(torch.equal(o.data, expected(x, SOLO)) for o, x in zip(objects, chain, strict=True))
    mgr.unpin(objects)

    assert mgr.flush(WAIT_S)
    for x in chain:
        got = tier.get(ChunkKey(x, SOLO))
        assert got is not None and torch.equal(got, expected(x, SOLO))
    pool_stats, [stats] = mgr.stats()
    assert pool_stats.num_pinned == 0 and pool_stats.num_writing == 0
    assert pool_stats.num_objects == 6
    assert stats.writes_total == 6 and stats.objects == 6 and stats.write_errors_total == 0
    assert (stats.write_queue_chunks, stats.write_queue_bytes, stats.skipped_writes_total) == (0, 0, 0)
    assert stats.promotions_total == 0
    assert stats.name == f"disk://{tier.root}"


def test_store_of_a_longer_chain_writes_only_the_new_chunks(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(5)
    store(mgr, SOLO, chain[:2])
    slots = store(mgr, SOLO, chain[2:], parent=chain[1])
    assert all(isinstance(s, PoolObject) for s in slots)
    again = store(mgr, SOLO, chain)  # all of it again: nothing new
    assert again == [ReserveFailure.ALREADY_PRESENT] * 5
    assert mgr.flush(WAIT_S)
    stats = tier_stats(mgr)
    assert stats.writes_total == 5 and stats.objects == 5
    assert mgr.stats()[0].num_pinned == 0
    hits = resolve(mgr.lookup(chain, specs(SOLO)))
    assert len(hits) == 5
    assert_hits(hits, chain, [SOLO])
    mgr.unpin(flat(hits))


def test_abort_frees_the_slots_and_nothing_is_written(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(3)
    slots = mgr.reserve(SOLO, chain, NBYTES, None)
    assert mgr.stats()[0].num_writing == 3
    mgr.abort([s for s in slots if isinstance(s, PoolObject)])
    pool_stats = mgr.stats()[0]
    assert (pool_stats.num_writing, pool_stats.num_objects, pool_stats.used_bytes) == (0, 0, 0)
    assert mgr.flush(WAIT_S)
    assert tier_stats(mgr).writes_total == 0
    assert not any(tier.contains(ChunkKey(x, SOLO)) for x in chain)


def test_store_without_lower_tiers_pins_nothing(make) -> None:
    mgr = make()
    store(mgr, SOLO, hashes(4))
    pool_stats, tiers = mgr.stats()
    assert tiers == []
    assert pool_stats.num_objects == 4 and pool_stats.num_pinned == 0
    assert mgr.flush(0.0)
    assert mgr.clear() == 4


def test_full_write_queue_skips_chunks_without_blocking_and_releases_them(make, disk) -> None:
    tier = disk(cls=GatedDiskTier, gate_writes=True)
    mgr = make(tier, write_queue_bytes=2 * NBYTES)
    chain = hashes(5)
    started = time.monotonic()
    store(mgr, SOLO, chain)  # the tier holds every write: only the queue's room decides
    assert time.monotonic() - started < WAIT_S / 2
    assert tier.waiting.wait(WAIT_S)  # the writer thread holds chunk 0 at the gate

    stats = tier_stats(mgr)
    assert stats.skipped_writes_total == 3
    assert (stats.write_queue_chunks, stats.write_queue_bytes) == (2, 2 * NBYTES)
    pool_stats = mgr.stats()[0]
    assert pool_stats.num_pinned == 2  # the queued two; the skipped three are released
    assert pool_stats.num_objects == 5
    assert mgr.clear() == 3  # the skipped chunks are evictable, the queued ones are not
    assert mgr.flush(0.05) is False  # still held at the gate

    tier.gate.set()
    assert mgr.flush(WAIT_S)
    stats = tier_stats(mgr)
    assert stats.writes_total == 2 and stats.skipped_writes_total == 3
    assert (stats.write_queue_chunks, stats.write_queue_bytes) == (0, 0)
    assert [tier.contains(ChunkKey(x, SOLO)) for x in chain] == [True, True, False, False, False]
    assert mgr.stats()[0].num_pinned == 0


def test_queued_chunks_are_never_evicted_under_memory_pressure(make, disk) -> None:
    tier = disk(cls=GatedDiskTier, gate_writes=True)
    mgr = make(tier, pool_bytes=64 * KiB, write_queue_bytes=3 * NBYTES)  # 16 slots
    queued = hashes(3, ns=1)
    store(mgr, SOLO, queued)
    assert tier.waiting.wait(WAIT_S)
    queued_objects = mgr.pin([ident(x, SOLO) for x in queued])
    assert queued_objects is not None
    mgr.unpin(queued_objects)

    for ns in range(2, 14):  # 48 more chunks through a pool of 16 slots; the queue is full
        slots = store(mgr, SOLO, hashes(4, ns=ns))
        assert ReserveFailure.NO_SPACE not in slots
    pool_stats = mgr.stats()[0]
    assert pool_stats.evictions >= 48 - 16 + 3
    assert tier_stats(mgr).skipped_writes_total == 48
    for obj, x in zip(queued_objects, queued, strict=True):
        assert obj.state is ObjectState.READY and obj.pins == 1
        assert torch.equal(obj.data, expected(x, SOLO))
    assert pool_stats.num_pinned == 3

    tier.gate.set()
    assert mgr.flush(WAIT_S)
    for x in queued:
        got = tier.get(ChunkKey(x, SOLO))
        assert got is not None and torch.equal(got, expected(x, SOLO))
    assert tier_stats(mgr).writes_total == 3
    assert mgr.stats()[0].num_pinned == 0


def test_two_tiers_each_get_every_chunk_and_promote_from_the_first_that_has_it(make, disk) -> None:
    first, second = disk("first"), disk("second")
    mgr = make(first, second)
    chain = hashes(6)
    store(mgr, SOLO, chain)
    assert mgr.flush(WAIT_S)
    assert mgr.stats()[0].num_pinned == 0  # one pin per writer, each released
    assert [s.writes_total for s in mgr.stats()[1]] == [6, 6]
    for x in chain[2:]:
        first.remove(ChunkKey(x, SOLO))
    assert mgr.clear() == 6

    hits = resolve(mgr.lookup(chain, specs(SOLO)))
    assert len(hits) == 6
    assert_hits(hits, chain, [SOLO])
    assert [s.promotions_total for s in mgr.stats()[1]] == [2, 4]
    release(mgr, hits)


# ---- read-through ---------------------------------------------------------------------------------


def test_read_through_promotes_from_disk_then_answers_from_l1(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(8)
    store(mgr, SOLO, chain)
    assert only_on_disk(mgr) == 8
    assert mgr.stats()[0].num_objects == 0

    result = mgr.lookup(chain, specs(SOLO))
    assert isinstance(result, Future)
    hits = result.result(timeout=WAIT_S)
    assert len(hits) == 8
    assert_hits(hits, chain, [SOLO])
    assert all(obj.pins == 1 for obj in flat(hits))
    pool_stats, [stats] = mgr.stats()
    assert pool_stats.num_pinned == 8 and pool_stats.num_writing == 0
    assert stats.promotions_total == 8 and stats.hits_total == 8
    release(mgr, hits)

    again = mgr.lookup(chain, specs(SOLO))
    assert isinstance(again, list)  # all in L1 now: answered at once
    assert [c[0] for c in again] == [c[0] for c in hits]  # the very objects promoted
    assert_hits(again, chain, [SOLO])
    assert tier_stats(mgr).promotions_total == 8
    release(mgr, again)


def test_read_through_extends_the_l1_prefix(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(6)
    store(mgr, SOLO, chain)
    only_on_disk(mgr)
    head = resolve(mgr.lookup(chain[:2], specs(SOLO)))  # chunks 0-1 back in L1
    mgr.unpin(flat(head))

    result = mgr.lookup(chain, specs(SOLO))
    assert isinstance(result, Future)
    hits = result.result(timeout=WAIT_S)
    assert len(hits) == 6
    assert [c[0] for c in hits[:2]] == [c[0] for c in head]
    assert_hits(hits, chain, [SOLO])
    assert all(obj.pins == 1 for obj in flat(hits))
    assert tier_stats(mgr).promotions_total == 6  # 2 + 4: none read twice
    release(mgr, hits)


def test_read_through_stops_at_a_chunk_that_is_nowhere(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(6)
    store(mgr, SOLO, chain[:3])
    store(mgr, SOLO, chain[4:], parent=chain[3])
    only_on_disk(mgr)
    hits = resolve(mgr.lookup(chain, specs(SOLO)))
    assert len(hits) == 3
    assert_hits(hits, chain, [SOLO])
    pool_stats = mgr.stats()[0]
    assert pool_stats.num_pinned == 3 and pool_stats.num_writing == 0
    assert pool_stats.num_objects == 3  # nothing read past the gap
    mgr.unpin(flat(hits))


def test_two_ranks_prefix_stops_where_one_rank_is_missing(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(6)
    store(mgr, RANK0, chain)
    store(mgr, RANK1, chain[:3])
    store(mgr, RANK1, chain[4:], parent=chain[3])  # rank 1 lacks chunk 3 only
    assert only_on_disk(mgr) == 11

    result = mgr.lookup(chain, specs(RANK0, RANK1))
    assert isinstance(result, Future)
    hits = result.result(timeout=WAIT_S)
    assert len(hits) == 3
    assert_hits(hits, chain, [RANK0, RANK1])
    assert all(obj.pins == 1 for obj in flat(hits))
    pool_stats = mgr.stats()[0]
    assert pool_stats.num_pinned == 6 and pool_stats.num_writing == 0
    assert pool_stats.num_objects == 6  # rank 0's slot for chunk 3 was given back
    assert mgr.pin([ident(chain[3], RANK0)]) is None
    assert tier_stats(mgr).promotions_total == 6
    release(mgr, hits)


def test_l1_for_one_rank_and_disk_for_the_other_are_combined(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(5)
    store(mgr, RANK0, chain)
    store(mgr, RANK1, chain)
    only_on_disk(mgr)
    # L1: chunk 0 of both ranks, chunks 1-4 of rank 0 only; rank 1's 1-4 are on disk only.
    both = resolve(mgr.lookup(chain[:1], specs(RANK0, RANK1)))
    rank0 = resolve(mgr.lookup(chain, specs(RANK0)))
    assert len(both) == 1 and len(rank0) == 5
    l1_rank0 = [c[0] for c in rank0]
    mgr.unpin(flat(both) + flat(rank0))
    assert tier_stats(mgr).promotions_total == 6

    result = mgr.lookup(chain, specs(RANK0, RANK1))
    assert isinstance(result, Future)
    hits = result.result(timeout=WAIT_S)
    assert len(hits) == 5
    assert_hits(hits, chain, [RANK0, RANK1])
    assert [c[0] for c in hits] == l1_rank0  # rank 0's are the L1 objects, not copies
    assert all(obj.pins == 1 for obj in flat(hits))
    assert tier_stats(mgr).promotions_total == 6 + 4  # only rank 1's chunks 1-4 were read
    mgr.unpin(flat(hits))
    pool_stats = mgr.stats()[0]
    assert (pool_stats.num_pinned, pool_stats.num_writing, pool_stats.num_objects) == (0, 0, 10)


def test_corrupt_object_mid_prefix_stops_it_and_is_removed(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(6)
    store(mgr, SOLO, chain)
    only_on_disk(mgr)
    bad = ChunkKey(chain[2], SOLO)
    path = file_of(tier, bad)
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x5A  # a payload byte: only the checksum can tell
    path.write_bytes(raw)

    hits = resolve(mgr.lookup(chain, specs(SOLO)))
    assert len(hits) == 2
    assert_hits(hits, chain, [SOLO])
    assert not path.exists() and not tier.contains(bad)
    assert tier_stats(mgr).corrupt_total == 1
    pool_stats = mgr.stats()[0]
    assert pool_stats.num_writing == 0
    assert pool_stats.num_pinned == 2  # the two hits only
    assert mgr.pin([bad.ident]) is None
    for x in chain[3:]:  # read fine after the corrupt one: kept in L1, unpinned, whole
        [obj] = mgr.pin([ident(x, SOLO)]) or [None]
        assert obj is not None and obj.pins == 1 and obj.state is ObjectState.READY
        assert torch.equal(obj.data, expected(x, SOLO))
        mgr.unpin([obj])
    release(mgr, hits)


def test_a_deleted_file_is_a_miss_and_frees_its_slot(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(4)
    store(mgr, SOLO, chain)
    only_on_disk(mgr)
    file_of(tier, ChunkKey(chain[1], SOLO)).unlink()  # still indexed, gone from the disk
    hits = resolve(mgr.lookup(chain, specs(SOLO)))
    assert len(hits) == 1
    assert_hits(hits, chain, [SOLO])
    pool_stats = mgr.stats()[0]
    assert pool_stats.num_writing == 0 and pool_stats.num_pinned == 1
    assert mgr.pin([ident(chain[1], SOLO)]) is None
    mgr.unpin(flat(hits))


def test_failed_reads_stop_the_prefix_and_free_the_slots(make, disk) -> None:
    tier = disk(cls=FailingReadsTier)
    mgr = make(tier)
    chain = hashes(4)
    store(mgr, SOLO, chain)
    only_on_disk(mgr)
    head = resolve(mgr.lookup(chain[:1], specs(SOLO)))  # nothing can be read
    assert head == []
    store(mgr, SOLO, chain[:1])  # chunk 0 back in L1 by a STORE
    assert mgr.flush(WAIT_S)
    hits = resolve(mgr.lookup(chain, specs(SOLO)))
    assert len(hits) == 1
    assert_hits(hits, chain, [SOLO])
    pool_stats, [stats] = mgr.stats()
    assert pool_stats.num_writing == 0 and pool_stats.num_pinned == 1 and pool_stats.num_objects == 1
    assert stats.promotions_total == 0
    mgr.unpin(flat(hits))


def test_a_chunk_of_another_size_is_a_miss(make, disk) -> None:
    tier = disk()
    mgr = make(tier)
    chain = hashes(3)
    store(mgr, SOLO, chain)
    only_on_disk(mgr)
    hits = resolve(mgr.lookup(chain, specs(SOLO, nbytes=2 * NBYTES)))
    assert hits == []
    pool_stats = mgr.stats()[0]
    assert (pool_stats.num_writing, pool_stats.num_pinned, pool_stats.num_objects) == (0, 0, 0)
    assert tier.contains(ChunkKey(chain[0], SOLO))  # not corrupt, just not this size


def test_lookups_without_lower_tiers_never_return_a_future(make) -> None:
    mgr = make()
    chain = hashes(5)
    store(mgr, RANK0, chain)
    store(mgr, RANK1, chain[:2])
    for query, combos, n in [(chain, specs(RANK0, RANK1), 2), (chain, specs(RANK0), 5),
                             (hashes(3, ns=9), specs(RANK0), 0), ([], specs(RANK0), 0)]:
        result = mgr.lookup(query, combos)
        assert isinstance(result, list) and len(result) == n
        assert_hits(result, query, [spec.fmt for spec in combos[0]])
        mgr.unpin(flat(result))
    assert mgr.stats()[0].num_pinned == 0


def test_full_l1_hit_with_lower_tiers_is_answered_at_once(make, disk) -> None:
    mgr = make(disk())
    chain = hashes(3)
    store(mgr, SOLO, chain)
    result = mgr.lookup(chain, specs(SOLO))
    assert isinstance(result, list) and len(result) == 3
    mgr.unpin(flat(result))
    assert mgr.flush(WAIT_S)
    assert mgr.stats()[0].num_pinned == 0


def test_a_prefix_that_surely_ends_is_answered_at_once(make, disk) -> None:
    mgr = make(disk())
    chain = hashes(5)
    store(mgr, SOLO, chain[:3])
    assert mgr.flush(WAIT_S)
    result = mgr.lookup(chain, specs(SOLO))  # chunk 3 is in no tier's index: no thread hop
    assert isinstance(result, list) and len(result) == 3
    assert_hits(result, chain, [SOLO])
    mgr.unpin(flat(result))
    mgr.clear()
    result = mgr.lookup(chain, specs(SOLO))  # chunk 0 is on disk: read through
    assert isinstance(result, Future)
    hits = result.result(timeout=WAIT_S)
    assert len(hits) == 3
    mgr.unpin(flat(hits))

    store(mgr, RANK0, chain[:2])  # rank 1 has chunk 0 nowhere
    assert mgr.flush(WAIT_S)
    assert mgr.lookup(chain, specs(RANK0, RANK1)) == []
    mgr.clear()
    assert mgr.lookup(chain, specs(RANK0, RANK1)) == []
    assert tier_stats(mgr).promotions_total == 3
    assert mgr.stats()[0].num_pinned == 0


def test_a_tier_without_an_in_memory_index_is_asked_on_the_reader_thread(make, disk) -> None:
    tier = disk(cls=FailingIndexTier)  # nothing made to fail: only contains_is_cheap is False
    mgr = make(tier)
    chain = hashes(4)
    store(mgr, SOLO, chain[:2])
    assert mgr.flush(WAIT_S)
    result = mgr.lookup(chain, specs(SOLO))
    assert isinstance(result, Future)
    hits = result.result(timeout=WAIT_S)
    assert len(hits) == 2
    assert_hits(hits, chain, [SOLO])
    release(mgr, hits)


def test_pending_promotions_are_bounded(make, disk, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_through, "MAX_PENDING_PROMOTIONS", 2)
    tier = disk(cls=GatedDiskTier, gate_reads=True)
    mgr = make(tier)
    chain = hashes(4)
    store(mgr, SOLO, chain)
    only_on_disk(mgr)
    store(mgr, SOLO, chain[:1])  # chunk 0 in L1, chunks 1-3 on disk only
    assert mgr.flush(WAIT_S)

    first = mgr.lookup(chain, specs(SOLO))
    assert isinstance(first, Future)
    assert tier.waiting.wait(WAIT_S)  # the reader thread is held in the tier
    second = mgr.lookup(chain, specs(SOLO))
    assert isinstance(second, Future)
    third = mgr.lookup(chain, specs(SOLO))  # past the bound: what L1 has, at once
    assert isinstance(third, list) and len(third) == 1
    assert_hits(third, chain, [SOLO])
    assert not first.done() and not second.done()

    tier.gate.set()
    a, b = first.result(timeout=WAIT_S), second.result(timeout=WAIT_S)
    assert len(a) == 4 and len(b) == 4
    assert_hits(a, chain, [SOLO])
    assert [c[0] for c in a] == [c[0] for c in b]
    assert a[0][0].pins == 3 and all(c[0].pins == 2 for c in a[1:])
    assert tier_stats(mgr).promotions_total == 3  # the second lookup found them in L1
    mgr.unpin(flat(a) + flat(b) + flat(third))
    assert mgr.stats()[0].num_pinned == 0

    mgr.clear()  # the bound was given back: the next lookups queue again
    results = [mgr.lookup(chain, specs(SOLO)) for _ in range(2)]
    assert all(isinstance(r, Future) for r in results)
    for r in results:
        mgr.unpin(flat(resolve(r)))
    assert mgr.stats()[0].num_pinned == 0


# ---- close ----------------------------------------------------------------------------------------


def test_close_finishes_queued_writes_and_releases_the_directory(make, disk, tmp_path: Path) -> None:
    tier = disk(cls=GatedDiskTier, gate_writes=True)
    mgr = make(tier)
    chain = hashes(10)
    store(mgr, SOLO, chain)
    assert tier.waiting.wait(WAIT_S)
    assert tier_stats(mgr).write_queue_chunks == 10  # nothing written when close starts
    opener = threading.Timer(0.2, tier.gate.set)
    opener.start()
    mgr.close()
    opener.join()
    assert mgr.stats()[0].num_pinned == 0
    assert tier_stats(mgr).writes_total == 10

    reopened = DiskTier(tmp_path / "disk", DISK_BYTES)  # the directory lock was released
    try:
        for x in chain:
            got = reopened.get(ChunkKey(x, SOLO))
            assert got is not None and torch.equal(got, expected(x, SOLO))
    finally:
        reopened.close()
    mgr.close()  # a second close is harmless


def test_close_is_bounded_when_a_tier_hangs(make, disk, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_module, "SHUTDOWN_FLUSH_S", 0.2)
    tier = disk(cls=GatedDiskTier, gate_writes=True)
    mgr = make(tier)
    store(mgr, SOLO, hashes(1))
    assert tier.waiting.wait(WAIT_S)  # its write is in flight, and hangs
    store(mgr, SOLO, hashes(2, ns=2))  # queued behind it
    started = time.monotonic()
    mgr.close()
    assert time.monotonic() - started < WAIT_S / 2
    assert mgr.stats()[0].num_pinned == 1  # the queued two were dropped; one write is in flight
    reopened = DiskTier(tmp_path / "disk", DISK_BYTES)
    reopened.close()
    tier.gate.set()  # the hung write ends (a closed tier stores nothing) and lets go of its pin
    assert wait_until(lambda: mgr.stats()[0].num_pinned == 0)
    store(mgr, SOLO, hashes(2, ns=1))  # a STORE after close: skipped for the tier, never pinned
    assert mgr.stats()[0].num_pinned == 0
    assert tier_stats(mgr).skipped_writes_total == 2


# ---- concurrency ----------------------------------------------------------------------------------


def test_concurrent_stores_and_lookups_never_return_wrong_bytes_or_leak(make, disk) -> None:
    tier = disk()
    mgr = make(tier, pool_bytes=256 * KiB, write_queue_bytes=64 * KiB)  # 64 slots: constant eviction
    chain = hashes(16)
    errors: list[BaseException] = []
    found = [0, 0]  # hits, of them read through (a Future)
    count_lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(100):
                n = rng.randint(1, len(chain))
                op = rng.random()
                if op < 0.45:
                    start = rng.randrange(n)
                    parent = chain[start - 1] if start else None
                    for fmt in (RANK0, RANK1):
                        store(mgr, fmt, chain[start:n], parent)
                else:
                    if op > 0.8:
                        mgr.clear()  # then the lookup most likely reads from disk
                    result = mgr.lookup(chain[:n], specs(RANK0, RANK1))
                    hits = resolve(result)
                    assert_hits(hits, chain, [RANK0, RANK1])
                    with count_lock:
                        found[0] += len(hits)
                        found[1] += isinstance(result, Future)
                    mgr.unpin(flat(hits))
        except BaseException as e:  # reported below, with the thread's traceback
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    assert found[0] > 0, found
    assert mgr.flush(WAIT_S)
    pool_stats = mgr.stats()[0]
    assert pool_stats.num_pinned == 0 and pool_stats.num_writing == 0
    # Whatever is left in L1 and on disk holds the right bytes.
    hits = resolve(mgr.lookup(chain, specs(RANK0, RANK1)))
    assert_hits(hits, chain, [RANK0, RANK1])
    mgr.unpin(flat(hits))
    mgr.clear()
    hits = resolve(mgr.lookup(chain, specs(RANK0, RANK1)))  # all of it from disk
    assert_hits(hits, chain, [RANK0, RANK1])
    mgr.unpin(flat(hits))
    for x in chain:
        for fmt in (RANK0, RANK1):
            got = tier.get(ChunkKey(x, fmt))
            assert got is None or torch.equal(got, expected(x, fmt))
    assert mgr.stats()[0].num_pinned == 0


# ---- races and failures found in review (each failed before its fix) ------------------------------


def _clear_until(mgr: StorageManager, stop: threading.Event) -> threading.Thread:
    """A thread that CLEARs L1 over and over until `stop`, as concurrent CLEAR requests would."""

    def run() -> None:
        while not stop.is_set():
            mgr.clear()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


RACE_S = 5.0  # the race below is hit within ~0.1 s on a 2-core machine; 5 s is a wide margin


def test_store_with_two_tiers_racing_clear_never_fails(make, disk) -> None:
    mgr = make(disk("first"), disk("second"), write_queue_bytes=0)  # both queues always full
    stop = threading.Event()
    clearer = _clear_until(mgr, stop)
    failures: list[ValueError] = []
    deadline = time.monotonic() + RACE_S
    ns = 0
    try:
        while time.monotonic() < deadline and not failures:
            ns += 1
            try:
                store(mgr, SOLO, hashes(4, ns=ns))
            except ValueError as e:
                failures.append(e)
    finally:
        stop.set()
        clearer.join(WAIT_S)
    assert failures == [], f"after {ns} stores: {failures[0]}"


def test_second_tier_writer_survives_a_racing_clear(monkeypatch: pytest.MonkeyPatch, make, disk) -> None:
    # A dead writer never drains: keep every close() short (monkeypatch is undone after `make`).
    monkeypatch.setattr(manager_module, "SHUTDOWN_FLUSH_S", 0.5)
    first = disk("first", cls=GatedDiskTier, gate_writes=True)
    second = disk("second")
    mgr = make(first, second, write_queue_bytes=16 * NBYTES)
    store(mgr, SOLO, hashes(16, ns=0))  # fills the first tier's queue (held at its gate)...
    assert first.waiting.wait(WAIT_S)
    assert wait_until(lambda: tier_stats(mgr, 1).write_queue_chunks == 0)  # ...the second's drains
    assert tier_stats(mgr, 1).writes_total == 16

    thread_errors: list[BaseException | None] = []
    store_errors: list[ValueError] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: thread_errors.append(args.exc_value)
    stop = threading.Event()
    clearer = _clear_until(mgr, stop)
    deadline = time.monotonic() + RACE_S
    ns = 0
    try:
        while time.monotonic() < deadline and not thread_errors:
            ns += 1
            try:
                store(mgr, SOLO, hashes(1, ns=ns))
            except ValueError as e:  # the other face of the same race (see the test above)
                store_errors.append(e)
    finally:
        stop.set()
        clearer.join(WAIT_S)
        time.sleep(0.1)  # let the second writer finish (or die on) what it holds
        threading.excepthook = previous_hook
        first.gate.set()
    flushed = mgr.flush(1.0)
    close_errors: list[ValueError] = []
    try:
        mgr.close()  # releases what is still queued: a chunk queued without its pin breaks that too
    except ValueError as e:
        close_errors.append(e)
    assert thread_errors == [], f"after {ns} stores, the second writer's thread died: {thread_errors[0]!r}"
    assert store_errors == []
    assert flushed
    assert close_errors == []
    assert mgr.stats()[0].num_pinned == 0


def test_read_through_finds_chunks_of_any_registered_format(make, disk) -> None:
    mgr = make(disk())
    other0, other1 = replace(RANK0, layout="other_layout"), replace(RANK1, layout="other_layout")
    chain = hashes(4)
    store(mgr, other0, chain)
    store(mgr, other1, chain)
    only_on_disk(mgr)
    control = resolve(mgr.lookup(chain, specs(other0, other1)))  # they are there...
    assert len(control) == 4
    mgr.unpin(flat(control))
    mgr.clear()
    # ...and each rank registered both formats (two engines of different layouts).
    hits = resolve(mgr.lookup(chain, specs(RANK0, RANK1) + specs(other0, other1)))
    mgr.unpin(flat(hits))
    assert len(hits) == 4


def test_a_failing_tier_index_leaves_no_writing_slots(make, disk) -> None:
    tier = disk(cls=FailingIndexTier)
    mgr = make(tier)
    chain = hashes(4)
    store(mgr, SOLO, chain)
    only_on_disk(mgr)
    tier.failing.add(ChunkKey(chain[2], SOLO))
    result = mgr.lookup(chain, specs(SOLO))
    assert isinstance(result, Future)
    try:
        hits = result.result(timeout=WAIT_S)
    except ConnectionError:
        hits = []
    assert_hits(hits, chain, [SOLO])
    mgr.unpin(flat(hits))
    pool_stats = mgr.stats()[0]
    assert pool_stats.num_pinned == 0
    assert pool_stats.num_writing == 0

    tier.failing.clear()  # the tier is back: the whole prefix is there to be read
    hits = resolve(mgr.lookup(chain, specs(SOLO)))
    mgr.unpin(flat(hits))
    assert len(hits) == 4


def test_close_with_a_queued_promotion_leaves_nothing_pinned(make, disk) -> None:
    tier = disk(cls=GatedDiskTier, gate_reads=True)
    mgr = make(tier)
    chain = hashes(3)
    store(mgr, SOLO, chain)
    only_on_disk(mgr)
    store(mgr, SOLO, chain[:1])  # chunk 0 in L1, chunks 1-2 on disk only
    assert mgr.flush(WAIT_S)
    running = mgr.lookup(chain, specs(SOLO))
    assert isinstance(running, Future)
    assert tier.waiting.wait(WAIT_S)  # the reader thread is held in the tier
    queued = mgr.lookup(chain, specs(SOLO))  # pins chunk 0, then waits for the reader thread
    assert isinstance(queued, Future)

    closer = threading.Thread(target=mgr.close)
    closer.start()
    assert wait_until(queued.cancelled)
    tier.gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    hits = running.result(timeout=WAIT_S)
    assert len(hits) == 3
    release(mgr, hits)
