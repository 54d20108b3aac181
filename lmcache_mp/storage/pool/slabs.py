"""The memory pool's slab allocator: its buffer carved into slabs of equal slots, one size per slab.

Every stored object is one chunk of one rank's KV, and all chunks of one layout have the same
size, so the pool is a slab allocator rather than a general heap. A *size class* (one exact object
size) owns whole slabs and cuts each into equal slots; objects never move, freeing is O(1), and
objects of one size never fragment. A slab that empties returns to the free list and can be handed
to another size class, which is how two layouts share the pool.

Slabs. The buffer is a row of equal *base slabs* of `slab_bytes` (the tail that doesn't fill one is
unused). Left as None, `slab_bytes` is fixed at the first reserve, from that first object size
(`default_slab_bytes`): a whole number of its slots (so its slabs have no slack), about 64 MiB but
at most 1/8 of the pool (so a second size class can still get slabs), and never less than one slot.
A size class whose slot fits a base slab uses one base slab per slab; a larger one uses `span`
consecutive base slabs per slab, which hold one object or a few. Free base slabs are kept as runs
(`FreeRuns`), so a span is found by first fit among a few runs.

Memory. The buffer is prepared (faulted in, pinned where CUDA is present) piece by piece from its
start, by `memory.PoolMemory`, maybe on a thread of its own. Only base slabs wholly inside
prepared pieces are ever free; the rest join the free runs as their pieces become ready
(`SlabAllocator.take_prepared`), so nothing is handed out of unprepared memory. Pieces end on base
slab boundaries once the slab size is fixed (`piece_boundary`; see `pool/memory.py` for why).

`SlabAllocator` owns the base slabs (which slab holds each, which are free, how far memory is
prepared) and the size classes; what the slots hold (objects, their states, the LRU) is
`pool.MemoryPool`'s. It is not thread-safe: the pool's lock guards both.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

# What a slot holds: the pool's objects (`pool.PoolObject`), which the allocator never looks into.
Obj = TypeVar("Obj")
# Every object's data starts on a cache line, which vectorised copies want.
ALIGN = 64
_TARGET_SLAB_BYTES = 64 << 20
_MIN_SLABS = 8


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def default_slab_bytes(slot_bytes: int, usable_bytes: int) -> int:
    """The rule in the module docstring: whole slots, ~64 MiB, at most 1/8 of the pool, >= one slot.
    Never more than `usable_bytes` when `slot_bytes` fits in it."""
    target = min(_TARGET_SLAB_BYTES, usable_bytes // _MIN_SLABS)
    return slot_bytes * max(1, -(-target // slot_bytes))


@dataclass(eq=False)
class SizeClass(Generic[Obj]):
    nbytes: int
    slot_bytes: int  # nbytes rounded up to the pool's alignment
    span: int  # base slabs per slab
    slots_per_slab: int
    # Slabs with at least one free slot, and READY unpinned objects, least recently used first.
    open_slabs: dict[Slab[Obj], None] = field(default_factory=dict)
    evictable: OrderedDict[Obj, None] = field(default_factory=OrderedDict)


@dataclass(eq=False)
class Slab(Generic[Obj]):
    first: int  # index of its first base slab
    offset: int  # of its first byte in the buffer
    size_class: SizeClass[Obj]
    objects: list[Obj | None]  # by slot
    free_slots: list[int]
    live: int = 0
    stuck: int = 0  # live objects that can't be evicted: WRITING or pinned

    @property
    def span(self) -> int:
        return self.size_class.span


class FreeRuns:
    """Free base slabs as maximal runs of consecutive indices, kept by both ends so that giving a
    run back coalesces with its neighbours in O(1); taking a single slab is O(1) too."""

    def __init__(self, count: int) -> None:
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}  # end (exclusive) -> start
        if count:
            self._add(0, count)

    def take(self, length: int) -> int | None:
        """First fit: the start of `length` free consecutive base slabs, now taken, or None."""
        start = next((start for start, run in self._by_start.items() if run >= length), None)
        if start is None:
            return None
        run = self._by_start[start]
        self._remove(start, run)
        if run > length:
            self._add(start + length, run - length)
        return start

    def give(self, start: int, length: int) -> None:
        end = start + length
        if end in self._by_start:
            right = self._by_start[end]
            self._remove(end, right)
            end += right
        if start in self._by_end:
            left = self._by_end[start]
            self._remove(left, start - left)
            start = left
        self._add(start, end - start)

    def _add(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]


class SlabAllocator(Generic[Obj]):
    """The base slabs of a pool's buffer and its size classes; see the module docstring. The
    buffer's usable part is `usable` bytes from offset `base` (where `align` first falls)."""

    def __init__(self, capacity_bytes: int, base: int, usable: int, align: int, slab_bytes: int | None):
        self.capacity_bytes = capacity_bytes
        self.base = base
        self.usable = usable
        self.align = align
        self.slab_bytes: int | None = None
        self.owner: list[Slab[Obj] | None] = []  # by base slab
        self.free = FreeRuns(0)
        self.ready_bytes = 0  # the prepared prefix of the buffer, as the pool has taken it in
        self.ready_slabs = 0  # base slabs [0, this) are wholly prepared: free or owned
        self.classes: dict[int, SizeClass[Obj]] = {}
        if slab_bytes is not None:
            if slab_bytes <= 0 or slab_bytes % align or slab_bytes > usable:
                raise ValueError(
                    f"slab_bytes must be a positive multiple of {align} of at most {usable}, "
                    f"got {slab_bytes}"
                )
            self._set_slab_bytes(slab_bytes)

    # ---- prepared memory -----------------------------------------------------------------------

    def piece_boundary(self, offset: int) -> int:
        """The piece boundary at or below buffer `offset`: a base slab boundary once the slab size is
        fixed and page-aligned (so objects rarely span two pieces), else a page boundary."""
        slab_bytes = self.slab_bytes
        if slab_bytes is None or slab_bytes % mmap.PAGESIZE or self.base % mmap.PAGESIZE:
            return offset - offset % mmap.PAGESIZE
        return self.base + (offset - self.base) // slab_bytes * slab_bytes

    def take_prepared(self, ready_bytes: int) -> None:
        """The buffer is prepared up to `ready_bytes`: its base slabs below that are free now."""
        self.ready_bytes = ready_bytes
        if self.slab_bytes is not None:
            self._free_prepared_slabs()

    def _free_prepared_slabs(self) -> None:
        covered = min(len(self.owner), max(0, (self.ready_bytes - self.base) // self.slab_bytes))
        for first in range(self.ready_slabs, covered):  # those not adopted (`adopt_slab`)
            if self.owner[first] is None:
                self.free.give(first, 1)
        self.ready_slabs = max(self.ready_slabs, covered)

    # ---- size classes and slabs ----------------------------------------------------------------

    def _set_slab_bytes(self, slab_bytes: int) -> None:
        self.slab_bytes = slab_bytes
        self.owner = [None] * (self.usable // slab_bytes)
        self.free = FreeRuns(0)
        self._free_prepared_slabs()

    def size_class(self, nbytes: int) -> SizeClass[Obj]:
        """The size class of objects of `nbytes`, made at the first ask (which fixes the slab size
        if it is still open); ValueError if such objects can never fit."""
        size_class = self.classes.get(nbytes)
        if size_class is not None:
            return size_class
        slot_bytes = round_up(nbytes, self.align)
        if nbytes <= 0 or slot_bytes > self.usable:
            raise ValueError(f"cannot store objects of {nbytes} bytes in a pool of {self.capacity_bytes} "
                             f"bytes: it can allocate at most {self.usable} contiguous bytes")
        if self.slab_bytes is None:
            self._set_slab_bytes(default_slab_bytes(slot_bytes, self.usable))
        slab_bytes = self.slab_bytes
        span = -(-slot_bytes // slab_bytes)
        if span > len(self.owner):
            raise ValueError(
                f"cannot store objects of {nbytes} bytes in a pool of {self.capacity_bytes} bytes: it can "
                f"allocate at most {len(self.owner) * slab_bytes} contiguous bytes "
                f"({len(self.owner)} slabs of {slab_bytes} bytes)"
            )
        size_class: SizeClass[Obj] = SizeClass(nbytes, slot_bytes, span, span * slab_bytes // slot_bytes)
        self.classes[nbytes] = size_class
        return size_class

    def new_slab(self, size_class: SizeClass[Obj]) -> Slab[Obj] | None:
        """A new, empty (and open) slab of `size_class` from free base slabs, or None."""
        first = self.free.take(size_class.span)
        if first is None:
            return None
        count = size_class.slots_per_slab
        slab = Slab(first, self.base + first * self.slab_bytes, size_class, [None] * count,
                    list(range(count - 1, -1, -1)))
        self.owner[first : first + size_class.span] = [slab] * size_class.span
        size_class.open_slabs[slab] = None
        return slab

    def adopt_slab(self, first: int, nbytes: int, span: int) -> Slab[Obj]:
        """The slab a pool file says starts at base slab `first`, for objects of `nbytes` (whose
        class must have `span`), taken before any base slab is free; ValueError if it can't be."""
        size_class = self.size_class(nbytes)
        if size_class.span != span or first + span > len(self.owner) or any(self.owner[first:first + span]):
            raise ValueError(f"a slab of span {span} at base slab {first} for {nbytes}-byte objects "
                             "does not fit this pool")
        count = size_class.slots_per_slab
        slab = Slab(first, self.base + first * self.slab_bytes, size_class, [None] * count, [])
        self.owner[first : first + span] = [slab] * span
        return slab

    def release(self, slab: Slab[Obj]) -> None:
        """An emptied slab's base slabs are free again."""
        slab.size_class.open_slabs.pop(slab, None)  # absent if it has a single slot
        self.owner[slab.first : slab.first + slab.span] = [None] * slab.span
        self.free.give(slab.first, slab.span)

    def cheapest_window(self, span: int) -> list[Slab[Obj]] | None:
        """For a multi-slab span, when no free run is long enough: the slabs to evict so that `span`
        consecutive base slabs are free, from the run without stuck slabs (a pinned or WRITING
        object) that has the fewest occupied base slabs (lowest address on ties), or None.
        O(number of base slabs): cold path only. Only prepared base slabs count: a window reaching
        past them could never be taken."""
        best, best_cost = None, span + 1
        cost = 0
        first_unblocked = 0  # windows must start after the last stuck base slab seen
        for i, slab in enumerate(self.owner[: self.ready_slabs]):
            if slab is not None and slab.stuck:
                first_unblocked = i + 1
            cost += slab is not None
            if i >= span:
                cost -= self.owner[i - span] is not None
            start = i - span + 1
            if start >= first_unblocked and cost < best_cost:
                best, best_cost = start, cost
        if best is None:
            return None
        return [slab for slab in dict.fromkeys(self.owner[best : best + span]) if slab is not None]
