"""The daemon's CPU memory pool (L1): chunk objects in one buffer allocated up front, pinned while
read, evicted least recently used first, prefixes before their tails.

Memory. One buffer, carved into slabs of equal slots, one object size per slab, by
`slabs.SlabAllocator`: the slab rules, and how the buffer is prepared piece by piece (with
`background` on a thread of its own, so the daemon answers at once whatever the pool's size; until
then a reserve may find NO_SPACE), are in `pool/slabs.py`.

Lifecycle. `reserve` hands out a WRITING object (invisible to readers, never evicted), or a
`ReserveFailure` for a key it can't serve; `commit` makes it READY (with `pin=True` also pinned, in
the same step, so it is never evictable in between), `abort` frees it. Readers `pin` READY objects
while they copy out of them. Only READY objects with no pins are evictable, least recently used
first (one LRU order per size class). A pin only counts at first; the object leaves its LRU, and
its slab counts it stuck, at the next eviction decision (`_settle`), so the LOOKUP that pins a
whole prefix on every rank pays one increment per object, and a pin that ends before any
eviction (the usual LOOKUP then RETRIEVE or END_SESSION) never touches the LRU.

Prefixes. The pool keeps parent links (`link`: the chunk before each one in its chain) and orders
recency so that eviction eats each chain from its tail, and what stays is a usable prefix: the
rules are `pool/chains.py`'.

Eviction, when a size class has no free slot and no free slab: its own LRU evictable object first
(that frees a slot of the right size); failing that, whole slabs of other classes, because a slot
of another size is of no use: the slab that became evictable longest ago (one base slab needed),
or, for a multi-slab span, the run of base slabs that needs the fewest cleared
(`SlabAllocator.cheapest_window`). Whole-slab eviction follows slabs, not chains, so it may take
a middle chunk of a prefix; the chunks after it are then dead weight, but they are older than the
chunks before it, so their own class evicts them before those. The slab scan runs only when slabs move
between size classes; reserving, committing, pinning and unpinning are otherwise O(1) per object
plus the ancestor walks of `chains.refresh` (a multi-slab span also walks the free runs, which are few).

One lock guards all bookkeeping, the allocator's included; no method ever copies object bytes, so
it is held briefly.

Warm restart. Given a `file.PoolFile`, the pool lives in that file, beside a record of each
object (`pool/records.py` writes them at commit and clears them at drop, in the order `pool/file.py`
explains), and a pool given a file that held one adopts its objects: READY, in their
old recency order and chains; those whose checksum is still to be verified are invisible to
readers until `pool/integrity.py`'s thread has (`take_unverified` / `verified`), which also seals new
objects (`take_unsealed` / `sealed`). That half of the pool is `restart.PoolRestart`.

Events. Given an `kv_events.EventLog`, the pool records there every object that becomes readable
(commit, a verified adoption) and every readable one it frees (eviction, clear, a failed check),
under its lock, so the log's order is the pool's; `announce` records every readable object again,
a slice at a time (a resync: `kv_events/resync.py`).

Dropping a model. `drop` takes the objects of some keys out of readers' sight at once, those in
use included (freed once released, or at their commit): `drop.PoolDrop`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from lmcache_mp.kv_events.log import EventLog
from lmcache_mp.kv_events.resync import Pass
from lmcache_mp.storage.pool.chains import descends_from, refresh
from lmcache_mp.storage.pool.drop import PoolDrop
from lmcache_mp.storage.pool.file import PoolFile
from lmcache_mp.storage.pool.memory import PIECE_BYTES, PinFn, PoolMemory
from lmcache_mp.storage.pool.objects import ObjectState, PoolObject, PoolStats, ReserveFailure
from lmcache_mp.storage.pool.records import PoolRecords
from lmcache_mp.storage.pool.restart import PoolRestart
from lmcache_mp.storage.pool.slabs import ALIGN, SizeClass, Slab, SlabAllocator, default_slab_bytes

if TYPE_CHECKING:  # the memory is a tensor; the pool itself computes no tensors
    import torch

logger = logging.getLogger(__name__)

__all__ = ["ALIGN", "MemoryPool", "ObjectState", "PoolObject", "PoolStats", "ReserveFailure",
           "default_slab_bytes"]

# `obj is not None` as a C-level callable (`takewhile` calls it once per key of a prefix walk).
_is_object = functools.partial(operator.is_not, None)


class MemoryPool(PoolRestart, PoolDrop):
    """Fixed-capacity, thread-safe store of KV chunk objects; see the module docstring."""

    def __init__(self, capacity_bytes: int, *, pin: PinFn | None = None, slab_bytes: int | None = None,
                 align: int = ALIGN, background: bool = False, piece_bytes: int = PIECE_BYTES,
                 backing: PoolFile | None = None, events: EventLog | None = None):
        """`align`: every object's data starts on a multiple of it (a power of two, >= ALIGN);
        the daemon asks for whole pages, which direct I/O (disk tier) needs. `pin`: page-locks each
        prepared piece (see `pool/memory.py`). `background`: prepare the memory on a thread of its own
        and return at once; otherwise it is all prepared before this returns. `piece_bytes`: how
        much is prepared (and pinned) at once, about. `backing`: the pool file to live in (of this
        capacity and alignment), whose objects are adopted if it held a pool (warm restart; its
        slab size then wins over `slab_bytes`). `events`: the log of what becomes readable and
        what stops being so (see the module docstring). `close` when done."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if align < ALIGN or align & (align - 1):
            raise ValueError(f"align must be a power of two of at least {ALIGN}, got {align}")
        self.capacity_bytes = capacity_bytes
        self.align = align
        # The only KV allocation this pool ever makes.
        self._memory = PoolMemory(capacity_bytes, pin, piece_bytes, backing)
        self._buffer = self._memory.tensor
        base = -self._buffer.data_ptr() % align
        self._records = PoolRecords(backing) if backing is not None else None
        self._events = events
        if backing is not None and backing.slab_bytes:
            slab_bytes = backing.slab_bytes
        self._slabs: SlabAllocator[PoolObject] = SlabAllocator(
            capacity_bytes, base, max(0, capacity_bytes - base), align, slab_bytes)
        self._lock = threading.Lock()
        self._index: dict[Hashable, PoolObject] = {}  # every live object, WRITING or READY
        self._readable: dict[Hashable, PoolObject] = {}  # the READY ones: what readers may pin
        # Slabs whose objects are all evictable, in the order they became so (oldest first).
        self._clean_slabs: OrderedDict[Slab[PoolObject], None] = OrderedDict()
        # Pinned objects still on their LRU: pinned since the last eviction decision (`_settle`).
        self._unsettled: dict[PoolObject, None] = {}
        # Objects dropped while pinned or WRITING, out of the index: freed when released (`drop`).
        self._doomed: set[PoolObject] = set()
        self._used = 0
        self._num_pinned = 0
        self._num_writing = 0
        self._evictions = 0
        if backing is not None and backing.adopted:
            self._adopt()
        if background:
            self._memory.prepare_in_background(self._piece_boundary, self._take_prepared)
        else:
            self._memory.prepare(self._piece_boundary, self._take_prepared)

    # ---- public API ----------------------------------------------------------------------------

    @property
    def memory(self) -> torch.Tensor:
        """All of the pool's memory, one flat uint8 tensor (a tier registers it for DMA)."""
        return self._buffer

    @property
    def slab_bytes(self) -> int | None:
        """Base slab size; None until the first reserve when it was left to the default rule."""
        return self._slabs.slab_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def num_objects(self) -> int:
        with self._lock:
            return len(self._index)

    def reserve(self, keys: list[Hashable], nbytes: int) -> list[PoolObject | ReserveFailure]:
        """Per key, in order: ReserveFailure.ALREADY_PRESENT if the key is live (even if still
        WRITING), else a new WRITING object of `nbytes`, evicting what it must, else
        ReserveFailure.NO_SPACE. A key repeated within the call gets its first answer again
        (ALREADY_PRESENT for one it got an object for): a later key's eviction may have taken it
        meanwhile, and one call never answers one key two ways. Raises ValueError, before
        reserving anything, if `nbytes` can never fit."""
        with self._lock:
            size_class = self._size_class(nbytes)
            first: dict[Hashable, PoolObject | ReserveFailure] = {}
            outcomes: list[PoolObject | ReserveFailure] = []
            for key in keys:
                earlier = first.get(key)
                if earlier is None:
                    outcome = first[key] = self._reserve_one(key, size_class)
                elif isinstance(earlier, PoolObject):
                    outcome = ReserveFailure.ALREADY_PRESENT
                else:
                    outcome = earlier
                outcomes.append(outcome)
            return outcomes

    def admit(self, nbytes: int) -> None:
        """Make sure objects of `nbytes` can be reserved, as the first reserve of that size would:
        raises ValueError, naming the most this pool can allocate contiguously, if they never can.
        Fixes the slab size when it is still open, so a later reserve of this size never raises."""
        with self._lock:
            self._size_class(nbytes)

    def commit(self, objects: list[PoolObject], *, pin: bool = False,
               records: list[tuple[bytes, bytes] | None] | None = None) -> list[PoolObject]:
        """WRITING -> READY: visible to readers. With `pin`, each object also gets one pin (release it
        with `unpin`) and is never evictable in between; without, the objects become the most recently
        used, the first of the list the most recent, and their ancestors more recent still.
        `records`, per object, for a file-backed pool: (parent's chunk hash, chunk head) to keep
        it across a restart (`pool/records.py`); an object without one is not kept. Returns the objects
        committed: all but those dropped while WRITING (`drop`), which are freed instead."""
        with self._lock:
            self._check_writing(objects)
            if self._doomed:
                objects, records = self._spare_doomed(objects, records)
            for i, obj in enumerate(objects):
                if self._records is not None:
                    self._records.committed(obj, records[i] if records is not None else None)
                obj.state = ObjectState.READY
                self._readable[obj.key] = obj
                self._announce(obj)
                self._num_writing -= 1
                if pin:
                    obj.pins = 1  # WRITING -> pinned: still held, its slab stuck on the same count
                    self._num_pinned += 1
            if not pin:
                self._make_evictable(objects)
                refresh(objects)
            return objects

    def link(self, keys: list[Hashable], parent: Hashable | None = None) -> None:
        """Record that keys[i - 1] is the parent of keys[i], and `parent` that of keys[0], where both
        are live (READY or WRITING); a key that isn't breaks the chain there, and no link is ever
        removed here (a parent that has been freed counts as none). Then refresh the chain (see
        `chains.refresh`): its live objects and `parent` become the most recently used, in reverse
        (`parent` the most recent), and their ancestors more recent still.

        A STORE links its keys before `reserve` too: that makes the part of its chain already here,
        and the parent, the most recent, so the reserve doesn't evict the prefix it extends."""
        with self._lock:
            prev = None if parent is None else self._index.get(parent)
            if prev is not None and descends_from(prev, {self._index.get(k) for k in keys}):
                prev = None  # a stale guess of the caller's (a chain stored again from its start)
            linked: list[PoolObject] = [] if prev is None else [prev]
            for key in keys:
                obj = self._index.get(key)
                if obj is not None:
                    if prev is not None and prev is not obj:
                        obj.parent = prev
                    linked.append(obj)
                prev = obj
            refresh(linked)

    def abort(self, objects: list[PoolObject]) -> None:
        """WRITING -> freed: the write failed and the slot is free again."""
        with self._lock:
            self._check_writing(objects)
            for obj in objects:
                self._num_writing -= 1
                self._drop(obj)
                self._unstick(obj.slab)

    def pin_prefix(self, chains: list[Iterable[Hashable]]) -> list[list[PoolObject]]:
        """The objects of the leading chunks whose every key is READY, one key per chain (a
        rank's keys, chunk by chunk), each pinned; per chunk its objects in chain order. A chain
        is drawn from only up to where the prefix ends (it may be lazy). Flattened, the result is
        chunk-major, the order `unpin` wants back.

        Built from C-level iterators, with no Python call per key: a LOOKUP runs this for its
        whole prefix on every rank, on the daemon's socket thread."""
        with self._lock:
            get = self._readable.get
            columns: list[list[PoolObject]] = []
            for chain in chains:
                if columns:  # no further than the chains before it reached
                    chain = itertools.islice(chain, len(columns[-1]))
                columns.append(list(itertools.takewhile(_is_object, map(get, chain))))
            if not columns:
                return []
            end = len(columns[-1])  # the shortest: each chain went no further than the one before
            chunks = list(map(list, zip(*(column[:end] for column in columns), strict=True)))
            self._pin_all([obj for objects in chunks for obj in objects])
            return chunks

    def holds(self, keys: list[Hashable]) -> list[bool]:
        """Whether each key's object is READY now (nothing pinned: it may go the next moment)."""
        with self._lock:
            return [key in self._readable for key in keys]

    def pin(self, keys: list[Hashable]) -> list[PoolObject] | None:
        """All or nothing: every key's object pinned, in order, or None (and nothing pinned)."""
        with self._lock:
            objects = self._ready(keys)
            if objects is not None:
                self._pin_all(objects)
            return objects

    def repin(self, objects: list[PoolObject]) -> None:
        """One more pin on each object, which the caller holds pinned already (so it can't have
        been evicted meanwhile). Raises ValueError, changing nothing, on an unpinned object."""
        with self._lock:
            for obj in objects:
                if obj.pins == 0 or obj.state is not ObjectState.READY:
                    raise ValueError(f"repin of {obj.key!r}: {obj.state.name} with {obj.pins} pin(s)")
            for obj in objects:
                obj.pins += 1

    def unpin(self, objects: list[PoolObject]) -> None:
        """Release one pin per occurrence; objects left with none become the most recently used, in
        chunk order like a commit (the first the most recent, its ancestors more recent still).
        Raises ValueError, changing nothing, if any object would drop below zero pins."""
        if not objects:
            return  # a miss, a lookup's one format combination: no lock, no walk
        with self._lock:
            for obj, count in Counter(objects).items():
                if obj.pins < count:
                    raise ValueError(f"unpin of {obj.key!r} {count} time(s), but it has {obj.pins} pin(s)")
            released: list[PoolObject] = []
            for obj in objects:
                obj.pins -= 1
                if obj.pins == 0:
                    released.append(obj)
            self._num_pinned -= len(released)
            self._make_evictable(released)
            refresh(released)

    def clear(self) -> int:
        """Drop every READY unpinned object; returns how many. Pinned and WRITING objects stay."""
        with self._lock:
            self._settle()
            victims = [obj for size_class in self._slabs.classes.values() for obj in size_class.evictable]
            for obj in victims:
                self._remove_evictable(obj)
            return len(victims)

    def discard(self, keys: list[Hashable]) -> int:
        """Drop the objects of these keys that are readable and unpinned (superseded: a request's
        tail once a longer one is stored); returns how many."""
        with self._lock:
            self._settle()  # pinned objects leave the LRU: only unpinned ones are found on it
            victims = [obj for obj in map(self._readable.get, keys)
                       if obj is not None and obj in obj.slab.size_class.evictable]
            for obj in victims:
                self._remove_evictable(obj)
            return len(victims)

    def announce(self, resync: Pass) -> None:
        """Record every readable object in the event log again (a resync after a clear): a snapshot
        of their keys, recorded slice by slice, the lock held for one slice at a time, each object
        still readable then (`kv_events/resync.py`)."""
        with self._lock:
            keys = list(self._readable)
        for piece in resync.slices(keys):
            with self._lock:
                for obj in map(self._readable.get, piece):
                    if obj is not None:
                        self._announce(obj)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self._used,
                num_objects=len(self._index),
                num_pinned=self._num_pinned,
                num_writing=self._num_writing,
                evictions=self._evictions,
                ready_bytes=self._slabs.ready_bytes,
                pinned_bytes=self._memory.pinned_bytes,
                pin_error=self._memory.pin_error,
                **self._record_stats(),
            )

    def close(self) -> None:
        """Stop preparing memory and unpin it; nothing may copy into or out of the pool after. A
        pool file stays, with what it holds, for the next start."""
        self._memory.close()
        if self._records is not None:
            self._records.file.close()

    # ---- prepared memory and slabs -------------------------------------------------------------

    def _piece_boundary(self, offset: int) -> int:
        with self._lock:
            return self._slabs.piece_boundary(offset)

    def _take_prepared(self, ready_bytes: int) -> None:
        with self._lock:
            self._slabs.take_prepared(ready_bytes)

    def _release_slab(self, slab: Slab[PoolObject]) -> None:
        self._clean_slabs.pop(slab, None)
        self._slabs.release(slab)
        if self._records is not None:
            self._records.slab_released(slab)

    def _size_class(self, nbytes: int) -> SizeClass[PoolObject]:
        """The allocator's size class; the first fixes the slab size, which a pool file keeps."""
        size_class = self._slabs.size_class(nbytes)
        if self._records is not None and self._slabs.slab_bytes is not None:
            self._records.slab_bytes_fixed(self._slabs.slab_bytes)
        return size_class

    # ---- reserving and eviction ----------------------------------------------------------------

    def _reserve_one(self, key: Hashable, size_class: SizeClass[PoolObject]) -> PoolObject | ReserveFailure:
        if key in self._index:
            return ReserveFailure.ALREADY_PRESENT
        slab = self._slab_with_free_slot(size_class)
        if slab is None:
            return ReserveFailure.NO_SPACE
        slot = slab.free_slots.pop()
        if not slab.free_slots:
            del size_class.open_slabs[slab]
        offset = slab.offset + slot * size_class.slot_bytes
        data = self._buffer.narrow(0, offset, size_class.nbytes)
        obj = PoolObject(key, size_class.nbytes, data, slab, slot, offset)
        slab.objects[slot] = obj
        slab.live += 1
        self._stick(slab)
        self._index[key] = obj
        self._used += obj.nbytes
        self._num_writing += 1
        return obj

    def _slab_with_free_slot(self, size_class: SizeClass[PoolObject]) -> Slab[PoolObject] | None:
        """A free slot, else a free slab, else evict (see the module docstring) and try again."""
        while True:
            if size_class.open_slabs:
                return next(iter(size_class.open_slabs))
            slab = self._slabs.new_slab(size_class)
            if slab is not None:
                if self._records is not None:
                    self._records.slab_taken(slab)
                return slab
            self._settle()
            if size_class.evictable:
                self._evict(next(iter(size_class.evictable)))
            elif not self._evict_slabs_for(size_class.span):
                return None

    def _evict_slabs_for(self, span: int) -> bool:
        """Free `span` consecutive base slabs by evicting whole clean slabs; False if impossible.
        Only called when the requesting class has nothing evictable, so every victim is another's."""
        if span == 1:
            if not self._clean_slabs:
                return False
            self._evict_slab(next(iter(self._clean_slabs)))
            return True
        victims = self._slabs.cheapest_window(span)
        if victims is None:
            return False
        for slab in victims:
            self._evict_slab(slab)
        return True

    def _evict_slab(self, slab: Slab[PoolObject]) -> None:
        for obj in [obj for obj in slab.objects if obj is not None]:
            self._evict(obj)

    def _evict(self, obj: PoolObject) -> None:
        self._remove_evictable(obj)
        self._evictions += 1

    # ---- object bookkeeping --------------------------------------------------------------------

    def _check_writing(self, objects: list[PoolObject]) -> None:
        """Validate a commit or abort up front, so a bad call changes nothing."""
        if len(set(objects)) != len(objects):
            raise ValueError("the same object appears twice")
        for obj in objects:
            if obj.state is not ObjectState.WRITING:
                raise ValueError(f"object {obj.key!r} is {obj.state.name}, not WRITING")

    def _ready(self, keys: list[Hashable]) -> list[PoolObject] | None:
        objects = list(map(self._readable.get, keys))
        return None if None in objects else objects  # type: ignore[return-value]

    def _pin_all(self, objects: list[PoolObject]) -> None:
        """One more pin on each (READY) object. Only the count: a LOOKUP pins its whole prefix on
        every rank on the daemon's socket thread, and most pins end (END_SESSION, RETRIEVE)
        before any eviction looks. The LRU and slab books learn of them in `_settle`."""
        newly = 0
        for obj in objects:
            if not obj.pins:
                newly += 1
            obj.pins += 1
        self._num_pinned += newly
        self._unsettled.update(dict.fromkeys(objects))  # C-level; held objects are skipped later

    def _settle(self) -> None:
        """Before any eviction decision: objects pinned since the last one leave their class's
        LRU and count as stuck in their slab (so no clean slab holds a pinned object); until then
        a pin only raised `pins`, and an object unpinned meanwhile never left the LRU."""
        stick = self._stick
        for obj in self._unsettled:
            if obj.pins and not obj.held:
                obj.held = True
                del obj.slab.size_class.evictable[obj]
                stick(obj.slab)
        self._unsettled.clear()

    def _make_evictable(self, objects: list[PoolObject]) -> None:
        """The objects are now READY and unpinned: evictable, as the most recently used (until
        `chains.refresh` puts the call's objects in their final order). One loop, no call per object: a
        LOOKUP's leases come back by the hundred. A pin that was never settled left its object
        on the LRU (`chains.refresh` moves it) and its slab clean: that slab is now the most recently
        clean, as if it had been stuck until now. Doomed objects (`drop`) are freed instead."""
        if self._doomed:
            objects = self._free_doomed(objects)
        unstick, clean, unsettled = self._unstick, self._clean_slabs, self._unsettled
        for obj in objects:
            unsettled.pop(obj, None)  # it holds pinned objects only: never more than are pinned
            if obj.held:
                obj.held = False
                obj.slab.size_class.evictable[obj] = None
                unstick(obj.slab)
            elif obj.slab in clean:
                clean.move_to_end(obj.slab)

    def _stick(self, slab: Slab[PoolObject]) -> None:
        slab.stuck += 1
        self._clean_slabs.pop(slab, None)

    def _unstick(self, slab: Slab[PoolObject]) -> None:
        slab.stuck -= 1
        if slab.stuck == 0 and slab.live:
            self._clean_slabs[slab] = None

    def _remove_evictable(self, obj: PoolObject) -> None:
        del obj.slab.size_class.evictable[obj]
        self._drop(obj)

    def _announce(self, obj: PoolObject) -> None:
        """Under the lock: record a readable object, with its chain's parent, if it has one."""
        if self._events is not None:
            parent = obj.parent
            parent_hash = parent.key[0] if parent is not None and parent.state is ObjectState.READY else None
            self._events.stored(0, obj.key, parent_hash)  # type: ignore[arg-type]

    def _drop(self, obj: PoolObject) -> None:
        """Free obj's slot (and its slab, if that empties). Stuck counts are the caller's job."""
        if self._records is not None:
            self._records.dropped(obj)  # first: its slot may be reused once this returns
        if self._doomed and obj in self._doomed:  # out of the index already, its key maybe reused
            self._doomed.discard(obj)
        else:
            del self._index[obj.key]
            if self._readable.pop(obj.key, None) is not None and self._events is not None:
                self._events.removed(0, obj.key)
        self._used -= obj.nbytes
        obj.state = ObjectState.FREED
        obj.parent = None  # a freed object has no chain; don't keep its ancestors alive
        slab = obj.slab
        slab.objects[obj.slot] = None
        slab.free_slots.append(obj.slot)
        slab.live -= 1
        if slab.live:
            slab.size_class.open_slabs[slab] = None
        else:
            self._release_slab(slab)
