"""The daemon's CPU memory pool: visibility, pins, LRU eviction, slabs shared by size classes."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_mp.protocol import ChunkOutcome
from lmcache_mp.storage.pool import ALIGN, MemoryPool, ObjectState, PoolObject, default_slab_bytes

KiB = 1024


def reserve_ready(pool: MemoryPool, keys: list, nbytes: int) -> list[PoolObject]:
    """Reserve and commit `keys`, which must all get an object."""
    objects = pool.reserve(keys, nbytes)
    assert all(isinstance(obj, PoolObject) for obj in objects), objects
    pool.commit(objects)
    return objects


def touch(pool: MemoryPool, keys: list) -> None:
    objects = pool.pin(keys)
    assert objects is not None
    pool.unpin(objects)


def assert_disjoint(objects: list[PoolObject]) -> None:
    spans = sorted((obj.data.data_ptr(), obj.data.data_ptr() + obj.nbytes) for obj in objects)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def live_keys(pool: MemoryPool, keys: list) -> set:
    """Which of `keys` are READY, without pinning them for good."""
    found = set()
    for key in keys:
        objects = pool.pin([key])
        if objects is not None:
            pool.unpin(objects)
            found.add(key)
    return found


# ---- reserve, commit, abort ------------------------------------------------------------------


def test_reserve_gives_aligned_writing_views_of_exact_size() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    objects = pool.reserve(["a", "b", "c"], 100)
    for obj in objects:
        assert obj.state is ObjectState.WRITING and obj.pins == 0
        assert obj.data.numel() == 100 and obj.data.dtype.itemsize == 1
        assert obj.data.data_ptr() % ALIGN == 0
    assert pool.used_bytes == 300 and pool.num_objects == 3
    assert pool.stats().num_writing == 3


def test_writing_object_is_invisible_until_commit() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    [obj] = pool.reserve(["a"], 64)
    assert pool.pin_prefix([["a"]]) == []
    assert pool.pin(["a"]) is None
    pool.commit([obj])
    assert obj.state is ObjectState.READY
    assert pool.pin_prefix([["a"]]) == [[obj]]
    assert obj.pins == 1
    assert pool.stats().num_pinned == 1 and pool.stats().num_writing == 0


def test_duplicate_keys_are_already_present() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    first, second = pool.reserve(["a", "a"], 64)
    assert isinstance(first, PoolObject) and second is ChunkOutcome.ALREADY_PRESENT
    assert pool.reserve(["a"], 64) == [ChunkOutcome.ALREADY_PRESENT]  # still WRITING
    pool.commit([first])
    assert pool.reserve(["a"], 128) == [ChunkOutcome.ALREADY_PRESENT]
    assert pool.num_objects == 1


def test_abort_frees_the_slot() -> None:
    pool = MemoryPool(KiB, slab_bytes=KiB)
    objects = pool.reserve(list(range(4)), 256)
    pool.abort(objects[:2])
    assert all(obj.state is ObjectState.FREED for obj in objects[:2])
    assert pool.num_objects == 2 and pool.used_bytes == 512
    assert pool.pin([0]) is None
    again = pool.reserve([0, 9], 256)
    assert all(isinstance(obj, PoolObject) for obj in again)
    assert pool.stats().evictions == 0


def test_commit_and_abort_misuse_raise_and_change_nothing() -> None:
    pool = MemoryPool(KiB, slab_bytes=KiB)
    a, b = pool.reserve(["a", "b"], 64)
    with pytest.raises(ValueError, match="twice"):
        pool.commit([a, a])
    assert a.state is ObjectState.WRITING
    pool.commit([a])
    with pytest.raises(ValueError, match="READY"):
        pool.commit([b, a])
    with pytest.raises(ValueError, match="READY"):
        pool.abort([a])
    assert b.state is ObjectState.WRITING and pool.stats().num_writing == 1


def test_objects_that_can_never_fit_raise() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    with pytest.raises(ValueError):
        pool.reserve(["a"], 4 * KiB + 1)
    with pytest.raises(ValueError):
        pool.reserve(["a"], 0)
    with pytest.raises(ValueError):
        MemoryPool(4 * KiB, slab_bytes=100)
    assert pool.num_objects == 0


# ---- pins and lookups ------------------------------------------------------------------------


def test_pin_prefix_stops_at_the_first_incomplete_chunk() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    chunks = [[(c, rank) for rank in range(2)] for c in range(4)]
    reserve_ready(pool, chunks[0] + chunks[2] + chunks[3] + [chunks[1][0]], 64)
    [writing] = pool.reserve([chunks[1][1]], 64)  # chunk 1 is incomplete until this commits

    pinned = pool.pin_prefix(chunks)
    assert [[obj.key for obj in objects] for objects in pinned] == [chunks[0]]
    assert all(obj.pins == 1 for obj in pinned[0])
    later = pool.pin(chunks[2] + chunks[3])
    assert later is not None and all(obj.pins == 1 for obj in later)  # pin_prefix left them alone
    pool.unpin(later)

    pool.commit([writing])
    assert [len(objects) for objects in pool.pin_prefix(chunks)] == [2, 2, 2, 2]
    assert all(obj.pins == 2 for obj in pinned[0])


def test_pin_is_all_or_nothing() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    a, b = reserve_ready(pool, ["a", "b"], 64)
    assert pool.pin(["a", "missing", "b"]) is None
    assert a.pins == 0 and b.pins == 0
    assert pool.pin(["b", "a", "b"]) == [b, a, b]
    assert a.pins == 1 and b.pins == 2 and pool.stats().num_pinned == 2


def test_unpin_misuse_raises_and_changes_nothing() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    a, b = reserve_ready(pool, ["a", "b"], 64)
    with pytest.raises(ValueError):
        pool.unpin([a])
    pool.pin(["a", "b"])
    with pytest.raises(ValueError):
        pool.unpin([b, a, a])
    assert a.pins == 1 and b.pins == 1
    pool.unpin([a, b])
    assert pool.stats().num_pinned == 0


# ---- eviction --------------------------------------------------------------------------------


def test_lru_eviction_and_touching_saves_an_object() -> None:
    pool = MemoryPool(KiB, slab_bytes=KiB)  # four 256-byte slots
    reserve_ready(pool, ["a", "b", "c", "d"], 256)
    touch(pool, ["a"])  # pin + unpin
    pool.pin_prefix([["b"], ["missing"], ["c"]])  # touches b; c comes after the gap
    pool.unpin(pool.pin(["b"]) * 2)

    reserve_ready(pool, ["e"], 256)
    assert live_keys(pool, list("abcde")) == set("abde")  # c was the least recently used
    reserve_ready(pool, ["f", "g"], 256)  # live_keys just touched a, b, d, e in that order
    assert live_keys(pool, list("abcdefg")) == set("defg")
    assert pool.stats().evictions == 3


def test_pinned_and_writing_objects_are_never_evicted() -> None:
    pool = MemoryPool(KiB, slab_bytes=KiB)
    objects = reserve_ready(pool, ["a", "b", "c"], 256)
    [writing] = pool.reserve(["w"], 256)
    pool.pin(["a", "b"])

    [new] = pool.reserve(["n"], 256)  # evicts c, the only evictable object
    assert objects[2].state is ObjectState.FREED
    assert pool.reserve(["x", "y"], 256) == [ChunkOutcome.NO_SPACE] * 2
    assert writing.state is ObjectState.WRITING and new.state is ObjectState.WRITING
    assert objects[0].pins == 1 and objects[1].pins == 1
    assert pool.num_objects == 4 and pool.used_bytes == KiB

    pool.unpin([objects[0]])
    [x] = pool.reserve(["x"], 256)
    assert isinstance(x, PoolObject) and objects[0].state is ObjectState.FREED


def test_no_space_leaves_earlier_reservations_of_the_call_alone() -> None:
    pool = MemoryPool(KiB, slab_bytes=KiB)
    old = reserve_ready(pool, ["old"], 256)[0]
    outcomes = pool.reserve(list(range(6)), 256)
    assert [isinstance(o, PoolObject) for o in outcomes] == [True] * 4 + [False] * 2
    assert outcomes[4:] == [ChunkOutcome.NO_SPACE] * 2
    assert old.state is ObjectState.FREED  # evicted for key 3, not the call's own reservations
    assert all(obj.state is ObjectState.WRITING for obj in outcomes[:4])


def test_clear_keeps_pinned_and_writing_objects() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    a, b, c = reserve_ready(pool, ["a", "b", "c"], 100)
    [writing] = pool.reserve(["w"], 100)
    pool.pin(["a"])
    assert pool.clear() == 2
    assert a.state is ObjectState.READY and writing.state is ObjectState.WRITING
    assert b.state is ObjectState.FREED and c.state is ObjectState.FREED
    assert pool.num_objects == 2 and pool.used_bytes == 200
    assert pool.stats().evictions == 0


# ---- slabs and size classes ------------------------------------------------------------------


def test_two_size_classes_share_slabs() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)  # four slabs of four 256-byte slots
    small = reserve_ready(pool, [("s", i) for i in range(16)], 256)
    touch(pool, [obj.key for obj in small[:4]])  # slab 0 is now the most recently used

    bigs = reserve_ready(pool, [("b", 0), ("b", 1)], 512)
    # A whole slab of the small class went (the one that became evictable longest ago), not slab 0.
    evicted = [obj for obj in small if obj.state is ObjectState.FREED]
    assert evicted == small[4:8]
    assert pool.stats().evictions == 4
    # The big class reuses that slab's memory.
    assert {obj.data.data_ptr() for obj in bigs} == {small[4].data.data_ptr(), small[6].data.data_ptr()}

    pinned = pool.pin([("b", 0), ("b", 1)])
    b2 = reserve_ready(pool, [("b", 2)], 512)[0]  # nothing big is evictable: another slab changes hands
    assert [obj for obj in small if obj.state is ObjectState.FREED] == small[4:12]
    reserve_ready(pool, [("b", 3)], 512)  # the free slot beside b2
    assert pool.stats().evictions == 8
    pool.unpin(pinned)
    reserve_ready(pool, [("b", 4)], 512)  # its own least recently used object goes before a small slab
    assert b2.state is ObjectState.FREED and pool.stats().evictions == 9


def test_a_slab_with_a_writing_object_keeps_its_class() -> None:
    pool = MemoryPool(2 * KiB, slab_bytes=KiB)
    small = pool.reserve(list(range(8)), 256)
    pool.commit(small[:3])  # slab 0 is partly committed, slab 1 fully, later
    pool.commit(small[4:])
    [big] = pool.reserve(["big"], 512)
    ready, writing, freed = ObjectState.READY, ObjectState.WRITING, ObjectState.FREED
    assert [obj.state for obj in small] == [ready] * 3 + [writing] + [freed] * 4
    assert big.data.data_ptr() == small[4].data.data_ptr()
    assert pool.reserve(["x", "y"], 512)[1] == ChunkOutcome.NO_SPACE  # x takes the slot beside big


def test_emptied_slab_goes_back_to_the_free_list() -> None:
    pool = MemoryPool(2 * KiB, slab_bytes=KiB)
    small = reserve_ready(pool, list(range(8)), 256)
    pool.clear()
    big = reserve_ready(pool, ["x", "y", "z", "w"], 512)
    assert pool.stats().evictions == 0
    assert {obj.data.data_ptr() for obj in big} == {small[i].data.data_ptr() for i in (0, 2, 4, 6)}


def test_objects_larger_than_a_slab_span_several() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    a, b = reserve_ready(pool, ["a", "b"], 1500)  # each takes two base slabs
    reserve_ready(pool, ["c"], 1500)  # evicts a, the least recently used
    assert a.state is ObjectState.FREED and b.state is ObjectState.READY
    assert pool.clear() == 2

    smalls = reserve_ready(pool, list(range(16)), 256)  # one per base slab at 0, 1, 2, 3
    pool.pin([0, 12])  # base slabs 0 and 3 are stuck; only slabs 1-2 can become free and adjacent
    [big] = pool.reserve(["big"], 1500)
    assert isinstance(big, PoolObject)
    assert {i for i, obj in enumerate(smalls) if obj.state is ObjectState.FREED} == set(range(4, 12))
    assert pool.reserve(["big2"], 1500) == [ChunkOutcome.NO_SPACE]


def test_default_slab_rule() -> None:
    assert default_slab_bytes(1024, 1 << 30) == 64 << 20
    assert default_slab_bytes(80 << 20, 1 << 40) == 80 << 20  # one big chunk per slab, no slack
    assert default_slab_bytes(24 << 20, 1 << 40) == 72 << 20  # a whole number of slots
    assert default_slab_bytes(1024, 64 * KiB) == 8 * KiB  # at most ~1/8 of a small pool
    assert default_slab_bytes(3072, 64 * KiB) == 9 * KiB  # ... rounded up to whole slots

    pool = MemoryPool(64 * KiB)
    assert pool.slab_bytes is None
    objects = pool.reserve(list(range(64)), 1000)  # slot 1024: 8 KiB slabs, 8 of them
    assert pool.slab_bytes == 8 * KiB
    assert sum(isinstance(obj, PoolObject) for obj in objects) == 64


def test_data_views_do_not_overlap() -> None:
    pool = MemoryPool(8 * KiB, slab_bytes=KiB)
    objects = reserve_ready(pool, list(range(12)), 200) + reserve_ready(pool, ["a", "b", "c"], 700)
    objects += reserve_ready(pool, ["big"], 1500)
    for value, obj in enumerate(objects, start=1):
        obj.data.fill_(value)
    for value, obj in enumerate(objects, start=1):
        assert bool((obj.data == value).all()), obj.key
    assert_disjoint(objects)


def test_concurrent_use_keeps_the_books_straight() -> None:
    pool = MemoryPool(16 * KiB, slab_bytes=2 * KiB)

    def worker(tid: int) -> None:
        for i in range(200):
            objects = [o for o in pool.reserve([(tid, i), (tid, i + 1)], 256) if isinstance(o, PoolObject)]
            pool.commit(objects)
            pinned = pool.pin_prefix([[(tid, i - 1)], [(tid, i)]])
            pool.unpin([obj for chunk in pinned for obj in chunk])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = pool.stats()
    assert stats.num_pinned == 0 and stats.num_writing == 0
    assert stats.num_objects == 64 and stats.used_bytes == 64 * 256


# ---- random sequences ------------------------------------------------------------------------

SIZES = [100, 300, 700, 1500]  # slots of 128, 320, 704 bytes, and one spanning two base slabs
KEYS = st.integers(0, 50)


class PoolMachine(RuleBasedStateMachine):
    """Random reserve/commit/abort/pin/unpin/clear sequences against a small pool; every object we
    were handed keeps the byte we filled it with for as long as it is alive."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = MemoryPool(4 * KiB, slab_bytes=KiB)
        self.objects: dict[PoolObject, int] = {}  # every object handed out -> its fill byte
        self.pins: dict[PoolObject, int] = {}
        self.fill = 0

    def alive(self) -> list[PoolObject]:
        return [obj for obj in self.objects if obj.state is not ObjectState.FREED]

    def in_state(self, state: ObjectState) -> list[PoolObject]:
        return [obj for obj in self.objects if obj.state is state]

    @rule(keys=st.lists(KEYS, max_size=4), nbytes=st.sampled_from(SIZES))
    def reserve(self, keys: list[int], nbytes: int) -> None:
        # A key live before the call may be evicted by an earlier key of the call, then reserved anew.
        before = {obj.key: obj for obj in self.alive()}
        seen: set[int] = set()
        for key, outcome in zip(keys, self.pool.reserve(keys, nbytes), strict=True):
            if isinstance(outcome, PoolObject):
                assert key not in seen and outcome.key == key and outcome.nbytes == nbytes
                assert key not in before or before[key].state is ObjectState.FREED
                self.fill = self.fill % 255 + 1
                outcome.data.fill_(self.fill)
                self.objects[outcome] = self.fill
            elif outcome is ChunkOutcome.ALREADY_PRESENT:
                assert key in before or key in seen
            else:
                assert outcome is ChunkOutcome.NO_SPACE
                continue
            seen.add(key)

    @precondition(lambda self: self.in_state(ObjectState.WRITING))
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data: st.DataObject, commit: bool) -> None:
        writing = self.in_state(ObjectState.WRITING)
        chosen = data.draw(st.lists(st.sampled_from(writing), min_size=1, unique_by=id))
        (self.pool.commit if commit else self.pool.abort)(chosen)

    @rule(chunks=st.lists(st.lists(KEYS, min_size=1, max_size=2), max_size=4))
    def pin_prefix(self, chunks: list[list[int]]) -> None:
        ready = {obj.key for obj in self.in_state(ObjectState.READY)}
        pinned = self.pool.pin_prefix(chunks)
        expected = 0
        while expected < len(chunks) and set(chunks[expected]) <= ready:
            expected += 1
        assert len(pinned) == expected
        for keys, objects in zip(chunks, pinned, strict=False):
            assert [obj.key for obj in objects] == keys
            for obj in objects:
                self.pins[obj] = self.pins.get(obj, 0) + 1

    @rule(keys=st.lists(KEYS, max_size=3))
    def pin(self, keys: list[int]) -> None:
        ready = {obj.key for obj in self.in_state(ObjectState.READY)}
        objects = self.pool.pin(keys)
        assert (objects is not None) == (set(keys) <= ready)
        for obj in objects or ():
            self.pins[obj] = self.pins.get(obj, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        obj = data.draw(st.sampled_from(list(self.pins)))
        self.pool.unpin([obj])
        self.pins[obj] -= 1
        if not self.pins[obj]:
            del self.pins[obj]

    @rule()
    def clear(self) -> None:
        evictable = [obj for obj in self.in_state(ObjectState.READY) if obj not in self.pins]
        assert self.pool.clear() == len(evictable)

    @invariant()
    def books_balance(self) -> None:
        alive = self.alive()
        stats = self.pool.stats()
        assert stats.num_objects == len(alive) == self.pool.num_objects
        assert stats.used_bytes == sum(obj.nbytes for obj in alive) == self.pool.used_bytes
        assert stats.used_bytes <= stats.capacity_bytes
        assert stats.num_writing == len(self.in_state(ObjectState.WRITING))
        assert stats.num_pinned == len(self.pins)

    @invariant()
    def pinned_objects_survive(self) -> None:
        for obj, pins in self.pins.items():
            assert obj.state is ObjectState.READY and obj.pins == pins

    @invariant()
    def live_objects_are_disjoint_and_intact(self) -> None:
        alive = self.alive()
        assert_disjoint(alive)
        for obj in alive:
            assert obj.data.data_ptr() % ALIGN == 0
            assert bool((obj.data == self.objects[obj]).all())


PoolMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
test_pool_state_machine = PoolMachine.TestCase
