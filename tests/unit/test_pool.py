"""The daemon's CPU memory pool: visibility, pins, LRU eviction, slabs shared by size classes, and its
memory's preparation (prepared pieces only; a pinning failure falls back to unpinned memory)."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import msgspec
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_mp.cli.status_text import render_status
from lmcache_mp.protocol import StatusReport
from lmcache_mp.storage.pool.pool import (
    ALIGN,
    MemoryPool,
    ObjectState,
    PoolObject,
    ReserveFailure,
    default_slab_bytes,
)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


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


def store(pool: MemoryPool, keys: list, parent=None, *, nbytes: int = 256, pin: bool = False) -> list:
    """One rank's STORE of a chain as the daemon does it: link (refreshing the part already here and
    the parent), reserve, link the new objects, commit them. Returns reserve's outcomes."""
    pool.link(keys, parent)
    outcomes = pool.reserve(keys, nbytes)
    assert ReserveFailure.NO_SPACE not in outcomes, outcomes
    pool.link(keys, parent)
    pool.commit([obj for obj in outcomes if isinstance(obj, PoolObject)], pin=pin)
    return outcomes


def is_prefix(alive: list[bool]) -> bool:
    return alive == sorted(alive, reverse=True)


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
    assert isinstance(first, PoolObject) and second is ReserveFailure.ALREADY_PRESENT
    assert pool.reserve(["a"], 64) == [ReserveFailure.ALREADY_PRESENT]  # still WRITING
    pool.commit([first])
    assert pool.reserve(["a"], 128) == [ReserveFailure.ALREADY_PRESENT]
    assert pool.num_objects == 1


def test_a_repeated_key_gets_its_first_answer_even_after_eviction() -> None:
    """Found by the state machine: key 10, present, answered ALREADY_PRESENT, was then evicted to
    make room for key 2 of the same call, and its repeat got a new object: one key, two answers."""
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    for chain in ([1, 10], [3]):
        objects = pool.reserve(chain, 700)
        pool.commit(objects)  # type: ignore[arg-type]
        pool.link(chain)
    outcomes = pool.reserve([0, 10, 2, 10], 700)
    assert outcomes[1] is outcomes[3] is ReserveFailure.ALREADY_PRESENT
    assert [isinstance(outcome, PoolObject) for outcome in outcomes] == [True, False, True, False]


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


def test_commit_with_pin_pins_each_object_at_once() -> None:
    pool = MemoryPool(2 * KiB, slab_bytes=KiB)  # two slabs of four 256-byte slots
    pinned = pool.reserve([("p", i) for i in range(4)], 256)  # slab 0
    pool.commit(pinned, pin=True)
    assert all(obj.state is ObjectState.READY and obj.pins == 1 for obj in pinned)
    stats = pool.stats()
    assert stats.num_pinned == 4 and stats.num_writing == 0
    assert pool.clear() == 0
    assert [len(chunk) for chunk in pool.pin_prefix([[obj.key for obj in pinned]])] == [1] * 4
    pool.unpin(pinned)  # the lookup's pins go; the commit's stay
    assert all(obj.pins == 1 for obj in pinned)

    others = reserve_ready(pool, [("o", i) for i in range(4)], 256)  # slab 1
    # The others are evictable and go; the pinned ones don't, and their slab can't change hands.
    assert all(isinstance(obj, PoolObject) for obj in pool.reserve(["x", "y"], 256))
    assert pool.reserve(["big"], 512) == [ReserveFailure.NO_SPACE]
    assert pool.reserve(["z", "w", "v"], 256)[2] == ReserveFailure.NO_SPACE
    assert all(obj.state is ObjectState.FREED for obj in others)
    assert all(obj.state is ObjectState.READY for obj in pinned)

    pool.unpin(pinned)  # now evictable, the first the most recent
    assert pool.stats().num_pinned == 0
    [v] = pool.reserve(["v"], 256)
    assert isinstance(v, PoolObject)
    assert [obj.state for obj in pinned] == [ObjectState.READY] * 3 + [ObjectState.FREED]


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

    chains = [list(chain) for chain in zip(*chunks, strict=True)]  # per rank, its keys in chunk order
    pinned = pool.pin_prefix(chains)
    assert [[obj.key for obj in objects] for objects in pinned] == [chunks[0]]
    assert all(obj.pins == 1 for obj in pinned[0])
    later = pool.pin(chunks[2] + chunks[3])
    assert later is not None and all(obj.pins == 1 for obj in later)  # pin_prefix left them alone
    pool.unpin(later)

    pool.commit([writing])
    assert [len(objects) for objects in pool.pin_prefix(chains)] == [2, 2, 2, 2]
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


def test_lookup_pins_leave_nothing_behind_once_released() -> None:
    """A pin only counts until an eviction decision needs the books (lazy pins): the pool's
    record of such pins holds pinned objects only, so pins that come and go without eviction
    (the usual LOOKUP, then RETRIEVE or END_SESSION) leave nothing behind, however many."""
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    chain = [("k", i) for i in range(8)]
    reserve_ready(pool, chain, 256)
    held = pool.pin_prefix([chain[:2]])
    for _ in range(2000):
        pinned = pool.pin_prefix([chain])
        assert len(pinned) == 8
        pool.unpin([obj for objects in pinned for obj in objects])
    assert len(pool._unsettled) == 2  # the two still pinned
    pool.unpin([obj for objects in held for obj in objects])
    assert not pool._unsettled and pool.stats().num_pinned == 0
    assert pool.clear() == 8  # every object is evictable again


# ---- eviction --------------------------------------------------------------------------------


def test_lru_eviction_and_touching_saves_an_object() -> None:
    pool = MemoryPool(KiB, slab_bytes=KiB)  # four 256-byte slots
    for key in "abcd":  # one commit each: a is the least recently used
        reserve_ready(pool, [key], 256)
    touch(pool, ["a"])  # pin + unpin
    pool.pin_prefix([["b", "missing", "c"]])  # touches b; c comes after the gap
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
    assert pool.reserve(["x", "y"], 256) == [ReserveFailure.NO_SPACE] * 2
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
    assert outcomes[4:] == [ReserveFailure.NO_SPACE] * 2
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


def test_one_call_makes_its_first_object_the_most_recent() -> None:
    pool = MemoryPool(KiB, slab_bytes=KiB)  # four 256-byte slots
    *_, d = reserve_ready(pool, ["a", "b", "c", "d"], 256)  # chunk order: a the most recent
    reserve_ready(pool, ["e"], 256)
    assert d.state is ObjectState.FREED
    pool.unpin(pool.pin(["a", "b", "c"]))  # a lookup in chunk order, after e was stored
    reserve_ready(pool, ["f"], 256)
    assert live_keys(pool, list("abcdef")) == set("abcf")  # e went, not a


# ---- prefix-aware eviction -------------------------------------------------------------------


def test_link_records_parents_of_live_keys_only() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    a, b, d = pool.reserve(["a", "b", "d"], 64)
    pool.link(["a", "b", "c", "d"], parent="missing")  # WRITING objects can be linked
    assert a.parent is None and b.parent is a and d.parent is None  # no c: the chain breaks there
    pool.commit([a, b, d])
    [e] = reserve_ready(pool, ["e"], 64)
    pool.link(["e"], parent="d")
    assert e.parent is d
    pool.link(["e"])  # no parent given: the link stays
    assert e.parent is d

    pool.pin(["e"])
    assert pool.clear() == 3  # d goes; e, pinned, stays
    assert e.parent is d and d.state is ObjectState.FREED  # a freed parent counts as none...
    pool.unpin([e])
    assert e.parent is None  # ... and the first walk that meets it lets go of it
    [d2] = reserve_ready(pool, ["d"], 64)  # the same key again is a new object: no link yet
    pool.link(["d", "e"])
    assert e.parent is d2


def test_parent_cycles_do_not_trap_the_walks() -> None:
    pool = MemoryPool(KiB, slab_bytes=KiB)
    a, b = reserve_ready(pool, ["a", "b"], 256)
    pool.link(["a", "b"])
    pool.link(["b", "a"])  # keys that name prefixes can't do this, but the pool must not hang
    assert a.parent is b and b.parent is a
    touch(pool, ["a", "b"])
    assert len([o for o in pool.reserve(["c", "d", "e"], 256) if isinstance(o, PoolObject)]) == 3


class Prompts:
    """Prompts stored chunk by chunk on a few ranks, with the object each key last got, so a test
    can tell what survives without touching anything."""

    def __init__(self, pool: MemoryPool, ranks: int = 2) -> None:
        self.pool = pool
        self.ranks = ranks
        self.keys: list[list[list]] = []  # per prompt, per rank, its chunk keys in order
        self.objects: dict = {}  # key -> the object it last got

    def new(self, length: int, shared: list[list] | None = None) -> int:
        """A prompt of `length` chunks, the first ones (per rank) `shared` with an earlier prompt."""
        p = len(self.keys)
        first = shared or [[] for _ in range(self.ranks)]
        self.keys.append(
            [
                first[rank] + [(p, c, rank) for c in range(len(first[rank]), length)]
                for rank in range(self.ranks)
            ]
        )
        return p

    def store(self, p: int, start: int = 0, stop: int | None = None) -> None:
        """STORE chunks start..stop-1 of prompt p on every rank, naming chunk start-1 as the parent."""
        for keys in self.keys[p]:
            chain = keys[start:stop]
            outcomes = store(self.pool, chain, keys[start - 1] if start else None)
            self.objects.update(
                (key, obj) for key, obj in zip(chain, outcomes, strict=True) if isinstance(obj, PoolObject)
            )

    def lookup(self, p: int) -> int:
        """A LOOKUP of prompt p: pin its prefix on all ranks, chunk-major, and let go. Returns hits."""
        pinned = self.pool.pin_prefix(self.keys[p])
        self.pool.unpin([obj for chunk in pinned for obj in chunk])
        return len(pinned)

    def alive(self, p: int, rank: int = 0) -> list[bool]:
        return [
            key in self.objects and self.objects[key].state is not ObjectState.FREED
            for key in self.keys[p][rank]
        ]

    def assert_prefixes(self) -> None:
        for p in range(len(self.keys)):
            for rank in range(self.ranks):
                assert is_prefix(self.alive(p, rank)), (p, rank, self.alive(p, rank))


def test_eviction_leaves_every_prompt_a_prefix() -> None:
    """Prompts of 4-8 chunks on two ranks, some stored in two STOREs (chunked prefill) with other
    work in between, some extending an earlier prompt's first chunks, some looked up, under steady
    memory pressure: what survives of every prompt is a prefix of it, so all of it can be hit."""
    pool = MemoryPool(16 * KiB, slab_bytes=KiB)  # 64 slots of 256 bytes
    prompts = Prompts(pool)
    second_part: list[int] = []
    cut = 0  # prompts seen with some chunks gone and some left
    for i in range(60):
        shared = None
        if i % 4 == 3:  # shares its first three chunks with the prompt before last
            shared = [keys[:3] for keys in prompts.keys[-2]]
        p = prompts.new(4 + i % 5, shared)
        if i % 3 == 1:  # chunked prefill: its first 3 chunks now, the rest after the next prompt
            prompts.store(p, 0, 3)
            second_part.append(p)
        else:
            prompts.store(p)
            for q in second_part:
                prompts.store(q, 3)
            second_part.clear()
        if i % 5 == 4:
            prompts.lookup(p - 3)
        prompts.assert_prefixes()
        cut += sum(0 < sum(prompts.alive(q)) < len(prompts.alive(q)) for q in range(p + 1))
    assert pool.stats().evictions > 300
    assert cut  # prompts lost their tails, not only whole prompts


@pytest.mark.parametrize("lookup", ["pin_prefix", "pin"])
def test_a_looked_up_prompt_outlives_an_untouched_one(lookup: str) -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)  # 16 slots of 256 bytes
    prompts = Prompts(pool, ranks=1)
    a = prompts.new(8)
    b = prompts.new(8)
    prompts.store(a)
    prompts.store(b)  # the pool is full; a is older
    if lookup == "pin_prefix":
        assert prompts.lookup(a) == 8
    else:
        touch(pool, prompts.keys[a][0])

    prompts.store(prompts.new(4))  # evicts b's last four chunks: b keeps a prefix that can be hit
    assert prompts.alive(a) == [True] * 8
    assert prompts.alive(b) == [True] * 4 + [False] * 4
    prompts.store(prompts.new(4))
    assert prompts.alive(a) == [True] * 8 and not any(prompts.alive(b))
    prompts.store(prompts.new(2))  # only now does a go, from its tail
    assert prompts.alive(a) == [True] * 6 + [False] * 2


def test_storing_the_rest_of_a_prompt_refreshes_its_first_part() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)  # 16 slots of 256 bytes
    prompts = Prompts(pool, ranks=1)
    a = prompts.new(8)
    b = prompts.new(12)
    prompts.store(a, 0, 4)  # chunked prefill: a's first half, then all of b, then a's second half
    prompts.store(b)  # the pool is full
    prompts.store(a, 4)  # its reserve evicts b's tail, not a's first half
    assert prompts.alive(a) == [True] * 8
    assert prompts.alive(b) == [True] * 8 + [False] * 4
    prompts.store(prompts.new(8))  # a's whole chain is more recent than what is left of b
    assert prompts.alive(a) == [True] * 8 and not any(prompts.alive(b))


def test_a_store_extending_a_cached_prefix_keeps_it() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)  # 16 slots of 256 bytes
    prompts = Prompts(pool, ranks=1)
    a = prompts.new(6)
    prompts.store(a)
    prompts.store(prompts.new(10))  # full; a is the least recently used
    c = prompts.new(8, shared=[prompts.keys[a][0][:4]])  # a's first 4 chunks, then 4 of its own
    prompts.store(c)  # link before reserve: the 4 shared chunks are spared
    assert prompts.alive(c) == [True] * 8
    assert prompts.alive(a) == [True] * 4 + [False] * 2
    prompts.assert_prefixes()


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
    assert pool.reserve(["x", "y"], 512)[1] == ReserveFailure.NO_SPACE  # x takes the slot beside big


def test_emptied_slab_goes_back_to_the_free_list() -> None:
    pool = MemoryPool(2 * KiB, slab_bytes=KiB)
    small = reserve_ready(pool, list(range(8)), 256)
    pool.clear()
    big = reserve_ready(pool, ["x", "y", "z", "w"], 512)
    assert pool.stats().evictions == 0
    assert {obj.data.data_ptr() for obj in big} == {small[i].data.data_ptr() for i in (0, 2, 4, 6)}


def test_objects_larger_than_a_slab_span_several() -> None:
    pool = MemoryPool(4 * KiB, slab_bytes=KiB)
    a, b = reserve_ready(pool, ["a", "b"], 1500)  # each takes two base slabs; a the most recent
    reserve_ready(pool, ["c"], 1500)  # evicts b, the least recently used
    assert a.state is ObjectState.READY and b.state is ObjectState.FREED
    assert pool.clear() == 2

    smalls = reserve_ready(pool, list(range(16)), 256)  # one per base slab at 0, 1, 2, 3
    pool.pin([0, 12])  # base slabs 0 and 3 are stuck; only slabs 1-2 can become free and adjacent
    [big] = pool.reserve(["big"], 1500)
    assert isinstance(big, PoolObject)
    assert {i for i, obj in enumerate(smalls) if obj.state is ObjectState.FREED} == set(range(4, 12))
    assert pool.reserve(["big2"], 1500) == [ReserveFailure.NO_SPACE]


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
            pinned = pool.pin_prefix([[(tid, i - 1), (tid, i)]])
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
    """Random reserve/commit/abort/link/pin/unpin/clear sequences against a small pool; every object
    we were handed keeps the byte we filled it with for as long as it is alive, and eviction within
    a size class never takes an object before a READY unpinned descendant (linked chains of keys
    only ever run from a smaller key to a larger one, as prefix hashes can't form cycles)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = MemoryPool(4 * KiB, slab_bytes=KiB)
        self.objects: dict[PoolObject, int] = {}  # every object handed out -> its fill byte
        self.pins: dict[PoolObject, int] = {}
        self.parents: dict[PoolObject, PoolObject] = {}  # every link recorded
        self.fill = 0

    def alive(self) -> list[PoolObject]:
        return [obj for obj in self.objects if obj.state is not ObjectState.FREED]

    def in_state(self, state: ObjectState) -> list[PoolObject]:
        return [obj for obj in self.objects if obj.state is state]

    def parent(self, obj: PoolObject) -> PoolObject | None:
        parent = self.parents.get(obj)
        return parent if parent is not None and parent.state is not ObjectState.FREED else None

    def ancestors(self, obj: PoolObject) -> list[PoolObject]:
        out = []
        while (obj := self.parent(obj)) is not None:
            out.append(obj)
        return out

    def do_reserve(self, keys: list[int], nbytes: int) -> list[PoolObject | ReserveFailure]:
        # Own-class eviction is LRU, and ancestors are more recent than their READY unpinned
        # descendants: an object of this size evicted by this call took every such descendant of
        # this size with it (objects of other sizes may go in whole slabs, in no chain order).
        evictable = [
            obj for obj in self.in_state(ObjectState.READY) if obj not in self.pins and obj.nbytes == nbytes
        ]
        ancestors = {obj: [a for a in self.ancestors(obj) if a.nbytes == nbytes] for obj in evictable}
        # A key live before the call may be evicted by an earlier key of the call, then reserved anew.
        before = {obj.key: obj for obj in self.alive()}
        seen: set[int] = set()
        outcomes = self.pool.reserve(keys, nbytes)
        for key, outcome in zip(keys, outcomes, strict=True):
            if isinstance(outcome, PoolObject):
                assert key not in seen and outcome.key == key and outcome.nbytes == nbytes
                assert key not in before or before[key].state is ObjectState.FREED
                self.fill = self.fill % 255 + 1
                outcome.data.fill_(self.fill)
                self.objects[outcome] = self.fill
            elif outcome is ReserveFailure.ALREADY_PRESENT:
                assert key in before or key in seen
            else:
                assert outcome is ReserveFailure.NO_SPACE
                continue
            seen.add(key)
        for obj in evictable:
            if obj.state is not ObjectState.FREED:
                evicted = [a.key for a in ancestors[obj] if a.state is ObjectState.FREED]
                assert not evicted, f"{evicted} evicted before their descendant {obj.key}"
        return outcomes

    def do_link(self, keys: list[int], parent: int | None) -> None:
        live = {obj.key: obj for obj in self.alive()}
        prev = live.get(parent)
        for key in keys:
            obj = live.get(key)
            if obj is not None and prev is not None:
                self.parents[obj] = prev
            prev = obj
        self.pool.link(keys, parent)

    def add_pins(self, objects: list[PoolObject]) -> None:
        for obj in objects:
            self.pins[obj] = self.pins.get(obj, 0) + 1

    @rule(keys=st.lists(KEYS, max_size=4), nbytes=st.sampled_from(SIZES))
    def reserve(self, keys: list[int], nbytes: int) -> None:
        self.do_reserve(keys, nbytes)

    @precondition(lambda self: self.in_state(ObjectState.WRITING))
    @rule(data=st.data(), commit=st.booleans(), pin=st.booleans())
    def finish(self, data: st.DataObject, commit: bool, pin: bool) -> None:
        writing = self.in_state(ObjectState.WRITING)
        chosen = data.draw(st.lists(st.sampled_from(writing), min_size=1, unique_by=id))
        if commit:
            self.pool.commit(chosen, pin=pin)
            assert all(obj.state is ObjectState.READY and obj.pins == pin for obj in chosen)
            if pin:
                self.add_pins(chosen)
        else:
            self.pool.abort(chosen)

    @rule(
        data=st.data(),
        keys=st.lists(KEYS, min_size=1, max_size=5, unique=True).map(sorted),
        nbytes=st.sampled_from(SIZES),
        pin=st.booleans(),
    )
    def store_chain(self, data: st.DataObject, keys: list[int], nbytes: int, pin: bool) -> None:
        """A STORE of a chain: link, reserve, link, commit what it reserved (pinned or not)."""
        parent = data.draw(st.none() | st.integers(0, keys[0] - 1)) if keys[0] else None
        self.do_link(keys, parent)
        fresh = [obj for obj in self.do_reserve(keys, nbytes) if isinstance(obj, PoolObject)]
        self.do_link(keys, parent)
        self.pool.commit(fresh, pin=pin)
        if pin:
            self.add_pins(fresh)

    @precondition(lambda self: self.alive())
    @rule(data=st.data())
    def link(self, data: st.DataObject) -> None:
        live = sorted({obj.key for obj in self.alive()})
        keys = sorted(data.draw(st.lists(st.sampled_from(live) | KEYS, min_size=1, max_size=4, unique=True)))
        parent = data.draw(st.none() | st.sampled_from(live) | KEYS)
        self.do_link(keys, parent if parent is None or parent < keys[0] else None)

    @rule(chains=st.lists(st.lists(KEYS, max_size=4), min_size=1, max_size=2))
    def pin_prefix(self, chains: list[list[int]]) -> None:
        """Chains of one or two ranks, maybe of different lengths: the prefix ends at the shortest."""
        ready = {obj.key for obj in self.in_state(ObjectState.READY)}
        pinned = self.pool.pin_prefix(chains)
        chunks = [list(chunk) for chunk in zip(*chains, strict=False)]  # as long as the shortest chain
        expected = 0
        while expected < len(chunks) and set(chunks[expected]) <= ready:
            expected += 1
        assert len(pinned) == expected
        for keys, objects in zip(chunks, pinned, strict=False):
            assert [obj.key for obj in objects] == keys
            self.add_pins(objects)

    @rule(keys=st.lists(KEYS, max_size=3))
    def pin(self, keys: list[int]) -> None:
        ready = {obj.key for obj in self.in_state(ObjectState.READY)}
        objects = self.pool.pin(keys)
        assert (objects is not None) == (set(keys) <= ready)
        self.add_pins(objects or [])

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        objects = data.draw(st.lists(st.sampled_from(list(self.pins)), min_size=1, max_size=4, unique_by=id))
        self.pool.unpin(objects)
        for obj in objects:
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
    def links_are_the_recorded_ones(self) -> None:
        for obj in self.alive():
            parent = (
                obj.parent if obj.parent is not None and obj.parent.state is not ObjectState.FREED else None
            )
            assert parent is self.parent(obj)

    @invariant()
    def live_objects_are_disjoint_and_intact(self) -> None:
        alive = self.alive()
        assert_disjoint(alive)
        for obj in alive:
            assert obj.data.data_ptr() % ALIGN == 0
            assert bool((obj.data == self.objects[obj]).all())


PoolMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
test_pool_state_machine = PoolMachine.TestCase


def test_link_refuses_a_parent_that_would_close_a_cycle() -> None:
    """A request that stores its chain again from chunk 0 (after a failed load) may name its last
    chunk as the parent: the pool must not make chunk 0 a descendant of its own descendant."""
    pool = MemoryPool(8 * KiB, slab_bytes=KiB)
    chain = reserve_ready(pool, ["c0", "c1", "c2"], 256)
    pool.link(["c0", "c1", "c2"])
    pool.link(["c0", "c1"], parent="c2")
    assert chain[0].parent is None and chain[1].parent is chain[0] and chain[2].parent is chain[1]


class HeldPins:
    """A `pin` hook that records the pieces the pool pins and holds the preparing thread at the
    second piece until `release`: the pool is then prepared exactly up to the first piece."""

    def __init__(self) -> None:
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[int] = []
        self._gate = threading.Event()

    def __call__(self, address: int, nbytes: int):
        self.pinned.append((address, nbytes))
        if len(self.pinned) == 2:
            assert self._gate.wait(30)
        return lambda: self.unpinned.append(address)

    def release(self) -> None:
        self._gate.set()


def wait_for(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_only_prepared_pieces_are_handed_out() -> None:
    slab, capacity = 192 * KiB, 4 * MiB  # 21 slabs; pieces of about 1 MiB end on slab boundaries
    pins = HeldPins()
    pool = MemoryPool(capacity, pin=pins, slab_bytes=slab, background=True, piece_bytes=MiB)
    try:
        first_piece = MiB // slab * slab  # 5 slabs
        wait_for(lambda: pool.stats().ready_bytes == first_piece)
        start = pins.pinned[0][0]
        early = pool.reserve(list(range(10)), slab)
        placed = [obj for obj in early if isinstance(obj, PoolObject)]
        assert len(placed) == 5 and early[5:] == [ReserveFailure.NO_SPACE] * 5
        assert all(start <= o.data.data_ptr() and o.data.data_ptr() + slab <= start + first_piece
                   for o in placed)
        # An object larger than what is prepared finds NO_SPACE too, and the whole-slab search
        # never reaches into memory that is not ready.
        assert pool.reserve(["big"], 6 * slab) == [ReserveFailure.NO_SPACE]
        pool.commit(placed)

        pins.release()
        wait_for(lambda: pool.stats().ready_bytes == capacity)
        later = reserve_ready(pool, list(range(10, 26)), slab)
        assert len(later) == 16  # the other 16 slabs, no eviction needed
        assert_disjoint(placed + later)
        assert pool.stats().evictions == 0
    finally:
        pins.release()
        pool.close()
    # Pieces: consecutive, covering the buffer, ending on slab boundaries (the last at its end),
    # each unpinned on close.
    offsets = [address - start for address, _ in pins.pinned]
    ends = [offset + nbytes for offset, (_, nbytes) in zip(offsets, pins.pinned, strict=True)]
    assert offsets == [0, *ends[:-1]] and ends[-1] == capacity
    assert all(end % slab == 0 for end in ends[:-1])
    assert sorted(pins.unpinned) == sorted(address for address, _ in pins.pinned)


def test_slab_size_fixed_later_frees_only_prepared_slabs() -> None:
    # The default slab size is fixed at the first reserve; the slabs it makes are free only up
    # to what is prepared by then.
    pins = HeldPins()
    pool = MemoryPool(8 * MiB, pin=pins, background=True, piece_bytes=2 * MiB)
    try:
        wait_for(lambda: pool.stats().ready_bytes == 2 * MiB)
        got = pool.reserve(list(range(64)), 64 * KiB)  # slabs of 1 MiB (1/8 of the pool)
        assert pool.slab_bytes == MiB
        assert sum(isinstance(obj, PoolObject) for obj in got) == 32  # two prepared slabs of 16
        pins.release()
        wait_for(lambda: pool.stats().ready_bytes == 8 * MiB)
        assert sum(isinstance(obj, PoolObject) for obj in pool.reserve(list(range(64, 200)), 64 * KiB)) == 96
    finally:
        pins.release()
        pool.close()


def test_close_stops_preparing_between_pieces() -> None:
    pins = HeldPins()
    pool = MemoryPool(8 * MiB, pin=pins, background=True, piece_bytes=MiB)
    wait_for(lambda: len(pins.pinned) == 2)  # held in the second piece's pinning
    closer = threading.Thread(target=pool.close)
    closer.start()
    pins.release()
    closer.join(10)
    assert not closer.is_alive()
    assert len(pins.pinned) == 2 and pool.stats().ready_bytes == 2 * MiB  # no piece after the stop
    assert len(pins.unpinned) == 2


class PinsUntil:
    """A `pin` hook that pins the first `good` pieces, then fails as cudaHostRegister does where
    page-locking is not allowed (RLIMIT_MEMLOCK, a container policy, gVisor):
    `torch.cuda.check_error` raises torch.cuda.CudaError, a RuntimeError."""

    def __init__(self, good: int) -> None:
        self.good = good
        self.calls = 0
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[int] = []

    def __call__(self, address: int, nbytes: int):
        self.calls += 1
        if len(self.pinned) == self.good:
            # Built without __init__, which asks the CUDA runtime (absent here) for the message.
            err = torch.cuda.CudaError.__new__(torch.cuda.CudaError)
            RuntimeError.__init__(err, "out of memory")
            raise err
        self.pinned.append((address, nbytes))
        return lambda: self.unpinned.append(address)


@pytest.mark.parametrize(("good", "background"), [(0, True), (2, False)],
                         ids=["first-piece-background", "third-piece"])
def test_a_pinning_failure_leaves_the_rest_of_the_pool_unpinned_but_usable(
        good: int, background: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Pinning failed at the first piece, preparation stopped, and the pool never had any
    capacity (every STORE NO_SPACE). Now the rest is prepared unpinned: the whole capacity serves,
    it says how much is pinned and why no more (STATUS shows both), and pinning is not tried again."""
    slab, capacity = 192 * KiB, 4 * MiB  # 21 slabs; pieces of about 1 MiB
    pins = PinsUntil(good)
    with caplog.at_level(logging.WARNING, logger="lmcache_mp.storage.pool.memory"):
        pool = MemoryPool(capacity, pin=pins, slab_bytes=slab, background=background, piece_bytes=MiB)
        try:
            wait_for(lambda: pool.stats().ready_bytes == capacity)
            stats = pool.stats()
            pinned = sum(nbytes for _, nbytes in pins.pinned)
            assert stats.pinned_bytes == pinned and (pinned > 0) == (good > 0)
            assert stats.pin_error == "CudaError: out of memory"
            assert pins.calls == good + 1  # not once per remaining piece
            assert len(reserve_ready(pool, list(range(21)), slab)) == 21  # every slab, no eviction
        finally:
            pool.close()
    assert sorted(pins.unpinned) == sorted(address for address, _ in pins.pinned)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "out of memory" in warnings[0] and "copies stay correct, staged and slower" in warnings[0]


def test_status_says_how_much_of_the_pool_is_pinned() -> None:
    base = StatusReport("0.1.0", 1, 1.5, 256, ["ipc:///x"], pool_bytes=4 * GiB, pool_ready_bytes=4 * GiB,
                        pool_ready=True)
    assert "ready\n" in render_status("ipc:///x", base)  # no CUDA: nothing said about pinning
    pinned = msgspec.structs.replace(base, pool_pinned_bytes=4 * GiB)
    assert "ready, pinned\n" in render_status("ipc:///x", pinned)
    failed = msgspec.structs.replace(base, pool_pinned_bytes=GiB, pool_pin_error="CudaError: out of memory")
    text = render_status("ipc:///x", failed)
    assert "ready; pinned only 1.0 GiB (CudaError: out of memory)" in text and "slower" in text
