"""The pool's warm-restart half (`PoolRestart`, a base of `pool.MemoryPool`): adopting what a pool
file holds, and the primitives of `pool/integrity.py`'s thread, which seals new objects and verifies
adopted ones.

Adoption (at construction, before any reader): every live record of the file becomes a READY
object in its old slot, in commit order (the newest the most recently used), linked to its parent;
sealed ones stay invisible to readers until verified. From a file that may have outlived the
machine (not on a tmpfs: `pool/mount.py`), unsealed ones are dropped instead: nothing vouches for
their bytes there. The thread's primitives each take the pool's lock briefly; the checksums
themselves run outside it, on objects pinned in place (pinned without becoming more recently used:
a background check must not reorder the LRU).

A mixin: it works on `MemoryPool`'s state, declared below for the type checker, under its lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from lmcache_mp.kv_events.log import EventLog
from lmcache_mp.storage.pool.chains import refresh
from lmcache_mp.storage.pool.file import SEALED, Record
from lmcache_mp.storage.pool.objects import ObjectState, PoolObject
from lmcache_mp.storage.pool.records import Found, PoolRecords
from lmcache_mp.storage.pool.seal_process import ChecksumProcess
from lmcache_mp.storage.pool.slabs import Slab, SlabAllocator

logger = logging.getLogger(__name__)


class PoolRestart:
    """See the module docstring."""

    _lock: threading.Lock
    _records: PoolRecords | None
    _events: EventLog | None
    _buffer: torch.Tensor
    _slabs: SlabAllocator[PoolObject]
    _index: dict[Hashable, PoolObject]
    _readable: dict[Hashable, PoolObject]
    _clean_slabs: OrderedDict[Slab[PoolObject], None]
    _used: int
    _num_pinned: int

    if TYPE_CHECKING:  # `MemoryPool`'s, used here
        def _pin_all(self, objects: list[PoolObject]) -> None: ...
        def _make_evictable(self, objects: list[PoolObject]) -> None: ...
        def _remove_evictable(self, obj: PoolObject) -> None: ...
        def _announce(self, obj: PoolObject) -> None: ...

    # ---- warm restart: sealing and verifying (`pool/integrity.py`'s thread) -------------------------

    def take_unsealed(self) -> PoolObject | None:
        """The oldest committed object whose checksum is still to be written, pinned (without
        changing its recency: see `_unpin_in_place`), or None."""
        with self._lock:
            if self._records is None or not self._records.unsealed:
                return None
            obj = next(iter(self._records.unsealed))
            del self._records.unsealed[obj]
            self._pin_all([obj])
            return obj

    def sealed(self, obj: PoolObject) -> None:
        """`take_unsealed`'s object has its checksum written: unpinned, in place."""
        with self._lock:
            self._unpin_in_place(obj, fresh=True)

    def seal(self, obj: PoolObject, pace: Callable[[], None] | None = None,
             hasher: ChecksumProcess | None = None) -> None:
        """Checksum a pinned object's payload into its record (no lock held: it is pinned);
        `hasher`: in that child process (`pool/seal_process.py`)."""
        assert self._records is not None
        self._records.file.seal(obj.offset, obj.data, pace, hasher)

    def checksum_process(self) -> ChecksumProcess | None:
        """A child process that checksums the pool file's bytes (`pool/seal_process.py`); None without a
        pool file, or if it cannot start."""
        return self._records.file.checksum_process() if self._records is not None else None

    def mark_file_used(self) -> None:
        """Tell other daemons' starts that this pool file is in use (`PoolFile.mark_used`)."""
        if self._records is not None:
            self._records.file.mark_used()

    def take_unverified(self) -> tuple[PoolObject, Record] | None:
        """The most recently used adopted object still to be verified, pinned in place, and its
        record; None when there is none."""
        with self._lock:
            if self._records is None or not self._records.unverified:
                return None
            obj, record = self._records.unverified.popitem()
            self._pin_all([obj])
            return obj, record

    def verified(self, obj: PoolObject, ok: bool) -> None:
        """`take_unverified`'s object passed its check (readers see it now) or failed it (freed).
        Nobody else pins it meanwhile: readers can't see it."""
        with self._lock:
            assert self._records is not None
            self._unpin_in_place(obj)
            if obj.state is ObjectState.FREED:  # dropped while checked (`pool/drop.py`): gone already
                return
            if ok:
                self._records.stats.verified_total += 1
                self._readable[obj.key] = obj
                self._announce(obj)
            else:
                self._records.stats.dropped_total += 1
                logger.warning("pool: adopted chunk %r failed its checksum: freed", obj.key)
                self._remove_evictable(obj)

    def _unpin_in_place(self, obj: PoolObject, *, fresh: bool = False) -> None:
        """Release a pin of `take_*` without making the object more recently used: it stays where
        it was in its LRU, unless an eviction decision settled the pin meanwhile (a slow checksum
        while STOREs evict) and it left its LRU. It comes back then as the least recent if its
        parent was evicted meanwhile (a pin protects an object, not its prefix: no LOOKUP reaches
        it any more); else as the most recent, and a `fresh` one (just committed: sealed) with its
        ancestors more recent still, as its commit left it (`chains.refresh`). As the most recent
        alone, it outlived its prefix: a chunk kept that nothing could hit, in place of one that
        could."""
        obj.pins -= 1
        if obj.pins:
            return
        self._num_pinned -= 1
        settled = obj.held
        self._make_evictable([obj])
        if not settled or obj.state is not ObjectState.READY:
            return
        parent = obj.parent
        if parent is not None and parent.state is ObjectState.FREED:
            obj.parent = None
            obj.slab.size_class.evictable.move_to_end(obj, last=False)
        elif fresh:
            refresh([obj])

    def _record_stats(self) -> dict[str, object]:
        records = self._records
        if records is None:
            return {}
        return {"pool_file": str(records.file.path), "adoption": replace(records.stats),
                "unverified": len(records.unverified), "unsealed": len(records.unsealed)}

    # ---- warm restart: adoption -------------------------------------------------------------------

    def _adopt(self) -> None:
        """Take over the objects the pool file holds (see the module docstring): READY, in their
        order of commit (the newest the most recently used), linked to their parents."""
        assert self._records is not None
        records = self._records
        found = records.scan(self._adopt_slab, len(self._slabs.owner))
        if not records.file.in_memory:
            found = self._drop_unsealed(found)
        objects: list[PoolObject] = []
        for item in found:
            slab, slot, size_class = item.slab, item.slot, item.slab.size_class
            offset = slab.offset + slot * size_class.slot_bytes
            data = self._buffer.narrow(0, offset, size_class.nbytes)
            obj = PoolObject(item.pool_key, size_class.nbytes, data, slab, slot, offset,
                             state=ObjectState.READY, held=False)
            slab.objects[slot] = obj
            slab.live += 1
            self._index[obj.key] = obj
            self._used += obj.nbytes
            size_class.evictable[obj] = None
            if records.adopted(obj, item.record):
                self._readable[obj.key] = obj
            objects.append(obj)
        for item, obj in zip(found, objects, strict=True):
            parent = self._index.get(item.parent_key) if item.parent_key is not None else None
            if parent is not None and parent is not obj:
                obj.parent = parent
            if self._events is not None:
                self._events.know(item.record.key.fmt)
                if obj.key in self._readable:
                    self._announce(obj)
        self._settle_adopted_slabs()
        refresh(objects[::-1])  # the newest the most recent, each chain's ancestors more so
        logger.info("pool: adopted %d chunks (%.2f GiB) from %s, %d of them still to be verified",
                    len(objects), self._used / 2**30, records.file.path, len(records.unverified))

    def _drop_unsealed(self, found: list[Found]) -> list[Found]:
        """The sealed of `found`; the others' records are cleared (their slots stay free)."""
        assert self._records is not None
        records = self._records
        sealed = [item for item in found if item.record.state == SEALED]
        for item in found:
            if item.record.state != SEALED:
                records.file.clear_state(item.slab.offset + item.slot * item.slab.size_class.slot_bytes)
        dropped = len(found) - len(sealed)
        if dropped:
            records.stats.dropped_total += dropped
            logger.warning("pool: %d chunks of %s had no checksum yet: dropped, as the file is not on a "
                           "tmpfs (a machine crash may have left their bytes unwritten)", dropped,
                           records.file.path)
        return sealed

    def _adopt_slab(self, first: int, nbytes: int, span: int) -> Slab[PoolObject] | None:
        try:
            return self._slabs.adopt_slab(first, nbytes, span)
        except ValueError:
            return None

    def _settle_adopted_slabs(self) -> None:
        """Adopted slabs: empty ones are forgotten (freed as their memory is prepared), the others
        are clean, and open if they have a free slot."""
        for slab in dict.fromkeys(slab for slab in self._slabs.owner if slab is not None):
            if not slab.live:
                self._slabs.owner[slab.first : slab.first + slab.span] = [None] * slab.span
                assert self._records is not None
                self._records.slab_released(slab)
                continue
            slab.free_slots = [i for i in range(len(slab.objects) - 1, -1, -1) if slab.objects[i] is None]
            if slab.free_slots:
                slab.size_class.open_slabs[slab] = None
            self._clean_slabs[slab] = None
