"""What a file-backed pool writes about its objects, and what a restart reads back (warm restart).

`MemoryPool` calls these under its lock, at the moments `pool/file.py`'s crash-consistency order
names: `committed` after an object's bytes are written (before its STORE is answered), `dropped`
before its slot can be reused, and the slab hooks as slabs change hands. A pool without a file
has no `PoolRecords` at all.

Two queues, both bounded by the number of objects the pool holds:
- unsealed: COMMITTED objects whose checksum is still to be computed (off the request path, by
  `pool/integrity.py`'s thread; at a clean shutdown, all of them);
- unverified: objects adopted SEALED, which readers can't see until their checksum is checked,
  most recently used first (a chunk that fails is freed: a miss).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmcache_mp.chunks import pool_key
from lmcache_mp.storage.pool.file import COMMITTED, EMPTY, SEALED, PoolFile, Record
from lmcache_mp.storage.pool.objects import AdoptionStats, PoolObject

if TYPE_CHECKING:
    from lmcache_mp.storage.pool.slabs import Slab

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Found:
    """A live record of a slot, found on adoption."""

    record: Record
    slab: Slab[PoolObject]
    slot: int
    pool_key: Hashable = field(init=False)
    parent_key: Hashable | None = field(init=False)

    def __post_init__(self) -> None:
        key = self.record.key
        self.pool_key = key.ident
        self.parent_key = pool_key(self.record.parent, key.fmt) if self.record.parent else None


class PoolRecords:
    """The records of a file-backed pool (module docstring)."""

    def __init__(self, pool_file: PoolFile):
        self.file = pool_file
        self.seq = 0
        self.unsealed: dict[PoolObject, None] = {}  # oldest first
        self.unverified: dict[PoolObject, Record] = {}  # least recently used first
        self.stats = AdoptionStats()

    # ---- the hooks (under the pool's lock) -------------------------------------------------------

    def slab_bytes_fixed(self, slab_bytes: int) -> None:
        if self.file.slab_bytes != slab_bytes:
            self.file.slab_bytes = slab_bytes

    def slab_taken(self, slab: Slab[PoolObject]) -> None:
        self.file.set_slab_entry(slab.first, slab.size_class.nbytes, slab.span)

    def slab_released(self, slab: Slab[PoolObject]) -> None:
        self.file.clear_slab_entry(slab.first)

    def committed(self, obj: PoolObject, record: tuple[bytes, bytes] | None) -> None:
        """`obj`'s bytes are written: its record (parent hash, chunk head), then its state. An
        object without a record, or whose record does not fit, is served but not kept."""
        if record is None:
            return
        self.seq += 1
        parent, head = record
        if self.file.write_record(obj.offset, self.seq, parent, head):
            self.file.set_state(obj.offset, COMMITTED)
            obj.recorded = True
            self.unsealed[obj] = None

    def dropped(self, obj: PoolObject) -> None:
        if obj.recorded:
            self.file.set_state(obj.offset, EMPTY)
            obj.recorded = False
        self.unsealed.pop(obj, None)
        self.unverified.pop(obj, None)

    # ---- adoption ----------------------------------------------------------------------------------

    def scan(self, adopt_slab: Callable[[int, int, int], Slab[PoolObject] | None],
             base_slabs: int) -> list[Found]:
        """Every live record of the file's slabs among its first `base_slabs` (the table is sized
        for the smallest slabs there can be), each slab taken by `adopt_slab(first, nbytes, span)`
        (None: its entry does not fit this pool, and it is forgotten), the newest of each
        key only (an older one would be a bug's, not a crash's, but is freed all the same), oldest
        first. Slots without one are left EMPTY."""
        found: dict[Hashable, Found] = {}
        first, count = 0, min(base_slabs, self.file.entries)
        while first < count:
            nbytes, span = self.file.slab_entry(first)
            slab = adopt_slab(first, nbytes, span) if span else None
            if slab is None:
                if span:
                    logger.warning("pool file: slab table entry %d (%d-byte objects, span %d) does not "
                                   "fit this pool: forgotten", first, nbytes, span)
                    self.file.clear_slab_entry(first)
                first += 1
                continue
            slot_bytes = slab.size_class.slot_bytes
            for slot in range(slab.size_class.slots_per_slab):
                offset = slab.offset + slot * slot_bytes
                record = self.file.read_record(offset, nbytes)
                if record is None:
                    self.file.clear_state(offset)
                    continue
                this = Found(record, slab, slot)
                other = found.get(this.pool_key)
                if other is not None:
                    self.stats.dropped_total += 1
                    older = min(this, other, key=lambda f: f.record.seq)
                    self.file.clear_state(older.slab.offset + older.slot * slot_bytes)
                    if older is this:
                        continue
                found[this.pool_key] = this
            first += span
        records = sorted(found.values(), key=lambda f: f.record.seq)
        self.seq = records[-1].record.seq if records else 0
        return records

    def adopted(self, obj: PoolObject, record: Record) -> bool:
        """Count an adopted object and queue it: True if readers may see it now (it was not
        sealed: there is nothing to check it against, and the commit order vouches for it)."""
        obj.recorded = True
        self.stats.adopted_objects += 1
        self.stats.adopted_bytes += obj.nbytes
        if record.state == SEALED:
            self.unverified[obj] = record
            return False
        self.stats.adopted_unsealed += 1
        self.unsealed[obj] = None
        return True

